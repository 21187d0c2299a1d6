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
