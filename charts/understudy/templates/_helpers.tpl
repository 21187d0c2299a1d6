{{- define "understudy.labels" -}}
app.kubernetes.io/name: understudy
app.kubernetes.io/component: operator
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "understudy.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
{{- /* Labels of a monitoring object: (list $ extraLabels). */ -}}
{{- define "understudy.monitoringLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: understudy
app.kubernetes.io/component: monitoring
helm.sh/chart: {{ $.Chart.Name }}-{{ $.Chart.Version }}
app.kubernetes.io/managed-by: {{ $.Release.Service }}
app.kubernetes.io/instance: {{ $.Release.Name }}
{{- with merge (dict) (index . 1) $.Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}
