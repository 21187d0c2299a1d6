// Command fakegpu is a DRA kubelet plugin that publishes fake GPUs.
//
// It exists so the local test cluster (hack/cluster/up) has devices that look
// like the ones NVIDIA's DRA driver publishes (attributes uuid, productName,
// index, ...; capacity memory) without a GPU. It runs as a host process next
// to the kubelet, like the upstream e2e test driver
// (k8s.io/kubernetes/test/e2e/dra/test-driver), on the same
// k8s.io/dynamic-resource-allocation/kubeletplugin helper.
//
// Prepare writes one CDI spec per (claim, request) that sets environment
// variables in every container using the request:
//
//	UNDERSTUDY_GPU_UUIDS    comma-separated uuids of the allocated devices
//	UNDERSTUDY_GPU_INDICES  comma-separated indices
//	UNDERSTUDY_GPU_DEVICES  comma-separated device names (gpu-0, ...)
//	UNDERSTUDY_GPU_CLAIM    <namespace>/<claim name>
//
// Nothing is reserved on the host: "preparing" a fake GPU is writing that file.
package main

import (
	"context"
	"crypto/sha1"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

type config struct {
	kubeconfig   string
	nodeName     string
	driverName   string
	numDevices   int
	productName  string
	architecture string
	memory       string
	cdiDir       string
	registrarDir string
	pluginsDir   string
}

// cdiSpec is the subset of the CDI spec format that sets environment variables.
type cdiSpec struct {
	Version string      `json:"cdiVersion"`
	Kind    string      `json:"kind"`
	Devices []cdiDevice `json:"devices"`
}

type cdiDevice struct {
	Name           string            `json:"name"`
	ContainerEdits cdiContainerEdits `json:"containerEdits"`
}

type cdiContainerEdits struct {
	Env []string `json:"env,omitempty"`
}

// fakeGPU is one published device.
type fakeGPU struct {
	name  string
	uuid  string
	index int
}

type plugin struct {
	cfg     config
	gpus    map[string]fakeGPU // by device name
	mu      sync.Mutex
	written map[types.UID][]string // CDI files per claim
}

var nonAlnum = regexp.MustCompile(`[^a-zA-Z0-9_.-]`)

func main() {
	var cfg config
	klog.InitFlags(nil)
	flag.StringVar(&cfg.kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig of the cluster")
	flag.StringVar(&cfg.nodeName, "node-name", "", "node whose devices this plugin publishes (required)")
	flag.StringVar(&cfg.driverName, "driver-name", "gpu.understudy.dev", "DRA driver name")
	flag.IntVar(&cfg.numDevices, "num-devices", 4, "number of fake GPUs")
	flag.StringVar(&cfg.productName, "product-name", "Fake-A100", "productName attribute")
	flag.StringVar(&cfg.architecture, "architecture", "Ampere", "architecture attribute")
	flag.StringVar(&cfg.memory, "memory", "40Gi", "memory capacity of each device")
	flag.StringVar(&cfg.cdiDir, "cdi-dir", "/var/run/cdi", "directory for CDI spec files")
	flag.StringVar(&cfg.registrarDir, "plugin-registration-path", kubeletplugin.KubeletRegistryDir, "kubelet plugin registration directory")
	flag.StringVar(&cfg.pluginsDir, "plugins-dir", kubeletplugin.KubeletPluginsDir, "kubelet plugins directory; the socket goes in <dir>/<driver-name>")
	flag.Parse()
	if err := run(cfg); err != nil {
		klog.ErrorS(err, "fakegpu failed")
		os.Exit(1)
	}
}

func run(cfg config) error {
	if cfg.nodeName == "" {
		return fmt.Errorf("--node-name is required")
	}
	mem, err := resource.ParseQuantity(cfg.memory)
	if err != nil {
		return fmt.Errorf("--memory: %w", err)
	}
	restCfg, err := clientcmd.BuildConfigFromFlags("", cfg.kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return err
	}
	dataDir := filepath.Join(cfg.pluginsDir, cfg.driverName)
	for _, d := range []string{cfg.cdiDir, dataDir, cfg.registrarDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return err
		}
	}

	p := &plugin{cfg: cfg, gpus: map[string]fakeGPU{}, written: map[types.UID][]string{}}
	devices := make([]resourceapi.Device, 0, cfg.numDevices)
	for i := 0; i < cfg.numDevices; i++ {
		g := fakeGPU{name: fmt.Sprintf("gpu-%d", i), uuid: fakeUUID(cfg.nodeName, i), index: i}
		p.gpus[g.name] = g
		devices = append(devices, resourceapi.Device{
			Name: g.name,
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"type":                  {StringValue: ptr.To("gpu")},
				"uuid":                  {StringValue: ptr.To(g.uuid)},
				"productName":           {StringValue: ptr.To(cfg.productName)},
				"brand":                 {StringValue: ptr.To("Fake")},
				"architecture":          {StringValue: ptr.To(cfg.architecture)},
				"index":                 {IntValue: ptr.To(int64(i))},
				"minor":                 {IntValue: ptr.To(int64(i))},
				"cudaComputeCapability": {VersionValue: ptr.To("8.0.0")},
				"driverVersion":         {VersionValue: ptr.To("0.0.0")},
				"memory":                {IntValue: ptr.To(mem.Value())},
			},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
				"memory": {Value: mem},
			},
		})
	}

	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	helper, err := kubeletplugin.Start(ctx, p,
		kubeletplugin.DriverName(cfg.driverName),
		kubeletplugin.NodeName(cfg.nodeName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.PluginDataDirectoryPath(dataDir),
		kubeletplugin.RegistrarDirectoryPath(cfg.registrarDir),
	)
	if err != nil {
		return fmt.Errorf("start kubelet plugin: %w", err)
	}
	defer helper.Stop()
	resources := resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{
			cfg.nodeName: {Slices: []resourceslice.Slice{{Devices: devices}}},
		},
	}
	if err := helper.PublishResources(ctx, resources); err != nil {
		return fmt.Errorf("publish resources: %w", err)
	}
	klog.InfoS("fakegpu running", "driver", cfg.driverName, "node", cfg.nodeName, "devices", cfg.numDevices)
	<-ctx.Done()
	klog.InfoS("fakegpu stopping")
	return nil
}

// fakeUUID is stable per (node, index), shaped like an NVIDIA GPU UUID.
func fakeUUID(node string, index int) string {
	h := sha1.Sum([]byte(fmt.Sprintf("%s/%d", node, index)))
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16])
}

func (p *plugin) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		devs, err := p.prepare(claim)
		out[claim.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	return out, nil
}

func (p *plugin) prepare(claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
	}
	// Group the results by request: one CDI device per request.
	byRequest := map[string][]resourceapi.DeviceRequestAllocationResult{}
	var order []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != p.cfg.driverName {
			continue
		}
		if _, ok := byRequest[r.Request]; !ok {
			order = append(order, r.Request)
		}
		byRequest[r.Request] = append(byRequest[r.Request], r)
	}
	kind := p.cfg.driverName + "/gpu"
	var files []string
	var devices []kubeletplugin.Device
	for _, req := range order {
		results := byRequest[req]
		var uuids, indices, names []string
		for _, r := range results {
			g, ok := p.gpus[r.Device]
			if !ok {
				return nil, fmt.Errorf("claim %s/%s: unknown device %q", claim.Namespace, claim.Name, r.Device)
			}
			uuids = append(uuids, g.uuid)
			indices = append(indices, fmt.Sprint(g.index))
			names = append(names, g.name)
		}
		cdiName := nonAlnum.ReplaceAllString(fmt.Sprintf("claim-%s-%s", claim.UID, req), "_")
		env := []string{
			"UNDERSTUDY_GPU_UUIDS=" + strings.Join(uuids, ","),
			"UNDERSTUDY_GPU_INDICES=" + strings.Join(indices, ","),
			"UNDERSTUDY_GPU_DEVICES=" + strings.Join(names, ","),
			"UNDERSTUDY_GPU_CLAIM=" + claim.Namespace + "/" + claim.Name,
		}
		sort.Strings(env)
		spec := cdiSpec{Version: "0.3.0", Kind: kind, Devices: []cdiDevice{{Name: cdiName, ContainerEdits: cdiContainerEdits{Env: env}}}}
		buf, err := json.Marshal(spec)
		if err != nil {
			return nil, err
		}
		file := filepath.Join(p.cfg.cdiDir, fmt.Sprintf("%s-%s.json", nonAlnum.ReplaceAllString(p.cfg.driverName, "_"), cdiName))
		if err := writeAtomic(file, buf); err != nil {
			return nil, fmt.Errorf("write CDI spec: %w", err)
		}
		files = append(files, file)
		for i, r := range results {
			d := kubeletplugin.Device{PoolName: r.Pool, DeviceName: r.Device, Requests: []string{r.Request}, ShareID: r.ShareID}
			if i == 0 {
				// The CDI device covers the whole request; attach it once.
				d.CDIDeviceIDs = []string{kind + "=" + cdiName}
			}
			devices = append(devices, d)
		}
	}
	p.mu.Lock()
	p.written[claim.UID] = files
	p.mu.Unlock()
	klog.InfoS("prepared claim", "claim", klog.KObj(claim), "devices", len(devices))
	return devices, nil
}

func (p *plugin) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		p.mu.Lock()
		files, ok := p.written[c.UID]
		delete(p.written, c.UID)
		p.mu.Unlock()
		if !ok {
			// Written by an earlier run of this process: find them by claim UID.
			files, _ = filepath.Glob(filepath.Join(p.cfg.cdiDir, "*claim-"+string(c.UID)+"-*.json"))
		}
		var firstErr error
		for _, f := range files {
			if err := os.Remove(f); err != nil && !os.IsNotExist(err) && firstErr == nil {
				firstErr = err
			}
		}
		out[c.UID] = firstErr
		klog.InfoS("unprepared claim", "claim", c.String())
	}
	return out, nil
}

func (p *plugin) HandleError(ctx context.Context, err error, msg string) {
	klog.ErrorS(err, msg)
}

func writeAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
