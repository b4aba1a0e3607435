{{/* Labels of every object the chart makes (pod template labels stay deploy/'s: a chart
     upgrade does not roll the operator for a label). */}}
{{- define "ballast.labels" -}}
app.kubernetes.io/part-of: ballast
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}
{{- define "ballast.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
