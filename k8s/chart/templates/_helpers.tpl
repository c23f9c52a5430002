{{/* Names and labels. */}}

{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Short enough that KubeRay's derived names (<name>-<hash>-head-svc, ...) fit 63 chars. */}}
{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "pagedserve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "pagedserve.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pagedserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* GPU math. A Worker replica takes tensorParallelSize GPUs on one node. */}}

{{- define "pagedserve.gpusPerPod" -}}
{{- if kindIs "invalid" .Values.gpuWorkers.gpusPerPod -}}
{{- .Values.tensorParallelSize | int -}}
{{- else -}}
{{- .Values.gpuWorkers.gpusPerPod | int -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.replicasPerPod" -}}
{{- div (include "pagedserve.gpusPerPod" . | int) (.Values.tensorParallelSize | int) -}}
{{- end -}}

{{/* Worker replica bounds: an inline policy's own, else autoscaling.minReplicas/maxReplicas. */}}
{{- define "pagedserve.minReplicas" -}}
{{- $p := .Values.autoscaling.inline | default dict -}}
{{- if and (eq .Values.autoscaling.policy "inline") (hasKey $p "min_replicas") -}}
{{- $p.min_replicas | int -}}
{{- else -}}
{{- required "autoscaling.minReplicas is required (the GPU worker group's lower bound, in Worker replicas)" .Values.autoscaling.minReplicas | int -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.maxReplicas" -}}
{{- $p := .Values.autoscaling.inline | default dict -}}
{{- if and (eq .Values.autoscaling.policy "inline") (hasKey $p "max_replicas") -}}
{{- $p.max_replicas | int -}}
{{- else -}}
{{- required "autoscaling.maxReplicas is required (the GPU worker group's upper bound, in Worker replicas)" .Values.autoscaling.maxReplicas | int -}}
{{- end -}}
{{- end -}}

{{/* Pods for n Worker replicas: ceil(n / replicasPerPod). */}}
{{- define "pagedserve.podsFor" -}}
{{- $per := include "pagedserve.replicasPerPod" .root | int -}}
{{- div (add (.replicas | int) (sub $per 1)) $per -}}
{{- end -}}

{{/* The folder the engine loads; "" for the builtin default model. */}}
{{- define "pagedserve.modelDir" -}}
{{- if ne .Values.model.source "builtin" -}}
{{- $mount := trimSuffix "/" .Values.model.mountPath -}}
{{- if .Values.model.path -}}
{{- printf "%s/%s" $mount (trimSuffix "/" .Values.model.path) -}}
{{- else -}}
{{- $mount -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "pagedserve.fullname" .)) .Values.apiKey.existingSecret -}}
{{- end -}}

{{- define "pagedserve.apiKeyMountPath" -}}/etc/pagedserve/api-key{{- end -}}

{{/* Pod fragments shared by the head and the GPU workers. */}}

{{- define "pagedserve.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- end -}}

{{/* The API key Secret, mounted as a file on every Ray pod (a Router may run on any of them). */}}
{{- define "pagedserve.apiKeyVolume" -}}
{{- if .Values.apiKey.enabled }}
- name: api-key
  secret:
    secretName: {{ include "pagedserve.apiKeySecretName" . }}
    defaultMode: 0444
    items:
      - {key: {{ .Values.apiKey.secretKey }}, path: api-key}
{{- end }}
{{- end -}}

{{/*
Where deploy/Dockerfile's image has the pagedserve-haproxy command (the package's console script;
the image's build checks the path). Serve starts it as HAProxy: it binds HAProxy's statistics
page (8404) and Prometheus exporter (9101), which Ray's config binds to every interface, to
127.0.0.1, ties HAProxy to the actor that starts it, then becomes HAProxy
(serve_app/cluster/haproxy_launcher.py).
*/}}
{{- define "pagedserve.haproxyLauncher" -}}/home/ray/anaconda3/bin/pagedserve-haproxy{{- end -}}

{{/*
Settings every Ray process on the pod reads when it starts: Ray Serve's ingress (values.ingress;
with HAProxy, the launcher above as its binary), and the raylet's niceness for the worker
processes it starts (Ray's default, 15, lets any other process on the node preempt the engine's
matmul threads; serve_app.serve_at_normal_priority). Then the pod role's (.role) containerEnv,
which wins over these for a name set twice, and envFrom.
*/}}
{{- define "pagedserve.rayEnv" -}}
env:
  - {name: RAY_worker_niceness, value: "0"}
{{- if eq .root.Values.ingress "haproxy" }}
  - {name: RAY_SERVE_ENABLE_HA_PROXY, value: "1"}
  - {name: RAY_SERVE_THROUGHPUT_OPTIMIZED, value: "1"}
  - {name: RAY_SERVE_HAPROXY_BINARY_PATH, value: {{ include "pagedserve.haproxyLauncher" . }}}
{{- else }}
  - {name: RAY_SERVE_ENABLE_HA_PROXY, value: "0"}
  - {name: RAY_SERVE_PROXY_USE_GRPC, value: "1"}
{{- end }}
{{- with .role.containerEnv }}
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pagedserve.apiKeyMount" -}}
{{- if .Values.apiKey.enabled }}
- {name: api-key, mountPath: {{ include "pagedserve.apiKeyMountPath" . }}, readOnly: true}
{{- end }}
{{- end -}}

{{/*
The init container that fetches the checkpoint into the GPU pod's model volume. By default a
Hugging Face snapshot of config, tokenizer and safetensors files only; model.download.command
replaces it (any command that fills $MODEL_DIR).
*/}}
{{- define "pagedserve.downloadContainer" -}}
{{- $d := .Values.model.download -}}
- name: fetch-model
  image: {{ default (include "pagedserve.image" .) $d.image }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- if $d.command }}
  command:
    {{- toYaml $d.command | nindent 4 }}
  {{- else }}
  command:
    - python
    - -c
    - |
      import os
      from huggingface_hub import snapshot_download
      snapshot_download(repo_id=os.environ["HF_REPO_ID"], revision=os.environ["HF_REVISION"],
                        local_dir=os.environ["MODEL_DIR"],
                        allow_patterns=os.environ["ALLOW_PATTERNS"].split(","))
  {{- end }}
  env:
    - {name: MODEL_DIR, value: {{ include "pagedserve.modelDir" . | quote }}}
    - {name: HF_REPO_ID, value: {{ $d.repoId | quote }}}
    - {name: HF_REVISION, value: {{ $d.revision | quote }}}
    - {name: ALLOW_PATTERNS, value: {{ join "," $d.allowPatterns | quote }}}
    - {name: HF_HOME, value: /tmp/hf-home}
    - {name: HF_HUB_DISABLE_TELEMETRY, value: "1"}
    {{- if $d.tokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ $d.tokenSecret }}, key: HF_TOKEN}
    {{- end }}
  volumeMounts:
    - {name: model, mountPath: {{ .Values.model.mountPath }}}
  {{- with $d.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "pagedserve.securityContext" (dict "base" .Values.securityContext "override" $d.securityContext) | trim }}{{ . | nindent 2 }}{{ end }}
{{- end -}}

{{/*
A securityContext block: the chart-wide context (.base) with a pod role's own keys (.override)
in place of the same keys; a key the role sets to null is dropped. Nothing when both are empty.
*/}}
{{- define "pagedserve.securityContext" -}}
{{- $ctx := deepCopy (.base | default dict) -}}
{{- range $key, $value := (.override | default dict) -}}
{{- if kindIs "invalid" $value -}}
{{- $_ := unset $ctx $key -}}
{{- else -}}
{{- $_ := set $ctx $key $value -}}
{{- end -}}
{{- end -}}
{{- with $ctx }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
