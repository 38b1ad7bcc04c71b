{{/* Chart name, truncated to the 63 characters of a label value. */}}
{{- define "strata.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's resources. */}}
{{- define "strata.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "strata.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The selector labels of the operator pods. */}}
{{- define "strata.selectorLabels" -}}
app.kubernetes.io/name: {{ include "strata.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The app.kubernetes.io labels every object carries. */}}
{{- define "strata.labels" -}}
helm.sh/chart: {{ include "strata.chart" . }}
app.kubernetes.io/name: {{ include "strata.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: strata
{{- end }}

{{- define "strata.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "strata.serviceName" -}}
{{- include "strata.fullname" . }}
{{- end }}

{{- define "strata.tlsSecretName" -}}
{{- printf "%s-tls" (include "strata.fullname" .) }}
{{- end }}

{{- define "strata.certificateName" -}}
{{- printf "%s-serving" (include "strata.fullname" .) }}
{{- end }}

{{/* The hardened securityContext of every container the chart runs. operator.runAsUser null: no user,
group or fsGroup (OpenShift's restricted-v2 SCC assigns them from the namespace's range). */}}
{{- define "strata.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
{{- with .Values.operator.runAsUser }}
runAsUser: {{ int . }}
runAsGroup: {{ int . }}
{{- end }}
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "strata.podSecurityContext" -}}
runAsNonRoot: true
{{- with .Values.operator.runAsUser }}
runAsUser: {{ int . }}
runAsGroup: {{ int . }}
fsGroup: {{ int . }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The namespaceSelector of both webhooks: never the release namespace; in namespaced mode only the
watched namespaces. */}}
{{- define "strata.webhookNamespaceSelector" -}}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: NotIn
    values: [{{ .Release.Namespace | quote }}]
{{- if .Values.watchNamespaces }}
  - key: kubernetes.io/metadata.name
    operator: In
    values:
{{- range .Values.watchNamespaces }}
      - {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Checks values the schema cannot express. */}}
{{- define "strata.validate" -}}
{{- if has .Release.Namespace .Values.watchNamespaces }}
{{- fail (printf "watchNamespaces must not contain the release namespace %q: the webhooks skip it" .Release.Namespace) }}
{{- end }}
{{- end }}
