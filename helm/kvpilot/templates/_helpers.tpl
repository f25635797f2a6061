{{- define "kvpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpilot.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: kvpilot-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpilot.labels" -}}
{{ include "kvpilot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
What the operator does inside a watched namespace: reconcile InferenceServices (kopf patches
their annotations and status; it adds no finalizer, and removes one an older operator left),
watch their children (Deployments, Services, PodDisruptionBudgets, NetworkPolicies, API-key
Secrets: a change reconciles the owner; InferencePools are only written),
create and server-side apply the children (it never deletes one: a plan that stops fitting keeps
the last good Deployment, and deleting an InferenceService leaves its children to the garbage
collector), keep its peering record alive, and post events.
*/}}
{{- define "kvpilot.namespacedRules" -}}
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices/status]
  verbs: [get, patch]
# The SLO autoscaler sets replicas through the scale subresource (autoscaling.mode: slo).
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices/scale]
  verbs: [get, patch]
# Owner references with blockOwnerDeletion need this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
# Each service's NetworkPolicy (spec.network), and its InferencePool when it asks for one
# (spec.inferencePool; the Gateway API Inference Extension's CRD).
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch]
# Each service's API-key Secret (spec.auth.apiKey): created once with a random key (a server-side
# apply, hence patch), then read for its digest (status.auth, which the gateway checks); never
# rewritten or deleted. RBAC cannot narrow this to those Secrets: the operator can read every
# Secret of a watched namespace (README, "Security model"; watchNamespaces narrows it).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, list, watch, create, patch]
# Engine pods: their states explain a service that is not Ready; before a scale-down the autoscaler
# annotates them with a deletion cost (patch), so the ReplicaSet removes the idlest first.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch]
# The readiness gate of a service with LoRA adapters: set on a pod once it holds them.
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
# The inspection Job of a pvc:// model the spec and the catalog do not describe: made once per
# source (a server-side apply, hence patch) and read; its pod's result is read like an engine pod's.
# Never deleted: its ttlSecondsAfterFinished removes it.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, create, patch]
# The engine pods' ReplicaSets, read only: a pod counts (metrics, gateway traffic) only when its
# ReplicaSet is controlled by the service's own Deployment, not for carrying its labels.
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{- define "kvpilot.engineImage" -}}
{{- .Values.engine.image | default (printf "ghcr.io/kvpilot/kvpilot:%s" .Chart.AppVersion) -}}
{{- end -}}

{{- define "kvpilot.args" -}}
- operator
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- else }}
- --all-namespaces
{{- end }}
- --peering={{ .Values.peering.name }}
- --liveness=http://0.0.0.0:{{ .Values.livenessPort }}/healthz
- --autoscale-interval={{ .Values.autoscaler.intervalSeconds }}
{{- range .Values.autoscaler.prometheusUrlAllow }}
- {{ printf "--prometheus-url-allow=%s" . | quote }}
{{- end }}
{{- if and .Values.gateway.enabled .Values.autoscaler.gatewayQueue }}
- --gateway-pods={{ .Release.Namespace }}:app.kubernetes.io/name=kvpilot-gateway,app.kubernetes.io/instance={{ .Release.Name }}
{{- end }}
{{- range $gpu, $price := .Values.gpuPrices }}
- {{ printf "--gpu-price=%s=%v" $gpu $price | quote }}
{{- end }}
{{- /* A capacity class: its node labels (sorted, as range reads a map), then its own prices. */}}
{{- range $class, $spec := .Values.capacityClasses }}
{{- $labels := list }}
{{- range $key, $value := $spec.nodeSelector }}
{{- $labels = append $labels (printf "%s=%s" $key $value) }}
{{- end }}
- {{ printf "--capacity-class=%s=%s" $class (join "," $labels) | quote }}
{{- range $gpu, $price := $spec.gpuPrices }}
- {{ printf "--gpu-price=%s@%s=%v" $gpu $class $price | quote }}
{{- end }}
{{- end }}
{{- if eq .Values.logLevel "debug" }}
- --verbose
{{- end }}
{{- end -}}

{{- define "kvpilot.subject" -}}
- kind: ServiceAccount
  name: {{ include "kvpilot.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end -}}
