module understudy.local/dashboardlinter

go 1.24

require github.com/grafana/dashboard-linter v0.0.0-20241224134444-1765d94aec4a
