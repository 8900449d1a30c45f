{{/* The chart's name for kvepp's own objects: the release name, or "kvepp" for a release named so. */}}
{{- define "kvepp.name" -}}
{{- if eq .Release.Name "kvepp" -}}kvepp{{- else -}}{{ printf "%s-kvepp" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "kvepp.labels" -}}
app.kubernetes.io/name: kvepp
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The selector of kvepp's pods. */}}
{{- define "kvepp.selector" -}}
app: {{ include "kvepp.name" . }}
{{- end -}}

{{/* An image reference: repository and tag (the appVersion when empty). */}}
{{- define "kvepp.image" -}}
{{- printf "%s:%s" .image.repository (default .appVersion .image.tag) -}}
{{- end -}}

{{/* The container security context of every container the chart runs as 65532. */}}
{{- define "kvepp.containerSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* "true" when kvepp's replicas share their state: more than one replica, or activeActive.enabled. */}}
{{- define "kvepp.activeActive" -}}
{{- if or .Values.activeActive.enabled (gt (int .Values.replicaCount) 1) -}}true{{- end -}}
{{- end -}}
