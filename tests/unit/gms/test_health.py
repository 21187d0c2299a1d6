"""The health verdict over what NVML said (pure: no NVML here)."""

from __future__ import annotations

from understudy.gms.health import APPLICATION_XIDS, Sample, verdict


def sample(**kw: object) -> Sample:
    base: dict[str, object] = {
        "memory_total": 1 << 30,
        "memory_used": 0,
        "new_xids": (),
        "ecc_uncorrected": 0,
        "retired_pending": False,
        "lost": False,
    }
    return Sample(**{**base, **kw})  # type: ignore[arg-type]


def test_healthy() -> None:
    assert verdict(None, sample()) == (True, "", None)


def test_application_xids_leave_it_healthy() -> None:
    assert verdict(None, sample(new_xids=tuple(sorted(APPLICATION_XIDS)))) == (True, "", None)


def test_a_gpu_xid_is_sticky_and_the_first_one_names_it() -> None:
    healthy, reason, sticky = verdict(None, sample(new_xids=(13, 79, 48)))
    assert (healthy, reason, sticky) == (False, "Xid 79", "Xid 79")
    assert verdict(sticky, sample()) == (False, "Xid 79", "Xid 79")


def test_lost_overrides_and_sticks() -> None:
    healthy, reason, sticky = verdict("Xid 79", sample(lost=True))
    assert not healthy and reason == sticky == "GPU is lost (fell off the bus)"


def test_ecc_and_retired_pages_are_not_sticky() -> None:
    assert verdict(None, sample(ecc_uncorrected=3))[:2] == (False, "3 uncorrectable ECC errors")
    assert verdict(None, sample(retired_pending=True))[0] is False
    assert verdict(None, sample(ecc_uncorrected=None, retired_pending=None)) == (True, "", None)
