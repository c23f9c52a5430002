{{/*
The Serve config (serveConfigV2): one application, serve_app:build_app, whose args are
serve_app.config.AppConfig fields. Built as a dict and rendered with toYaml so it is always
valid YAML whatever the values hold.
*/}}
{{- define "pagedserve.appArgs" -}}
{{- $args := deepCopy .Values.app -}}
{{- $modelDir := include "pagedserve.modelDir" . -}}
{{- if $modelDir -}}
{{- $_ := set $args "model" $modelDir -}}
{{- end -}}
{{- if .Values.model.servedModelName -}}
{{- $_ := set $args "served_model_name" .Values.model.servedModelName -}}
{{- end -}}
{{- $_ := set $args "tensor_parallel_size" (.Values.tensorParallelSize | int) -}}
{{- /* Workers always ask for GPUs: with scale-to-zero there may be no GPU node at deploy time,
       and 'auto' would then place them on the head's CPUs. */ -}}
{{- $_ := set $args "accelerator" "gpu" -}}
{{- $policy := .Values.autoscaling.policy -}}
{{- if eq $policy "inline" -}}
{{- $policy = deepCopy .Values.autoscaling.inline -}}
{{- $_ := set $policy "min_replicas" (include "pagedserve.minReplicas" . | int) -}}
{{- $_ := set $policy "max_replicas" (include "pagedserve.maxReplicas" . | int) -}}
{{- end -}}
{{- $_ := set $args "autoscaling" $policy -}}
{{- if .Values.apiKey.enabled -}}
{{- $_ := set $args "api_key_file" (printf "%s/api-key" (include "pagedserve.apiKeyMountPath" .)) -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{- define "pagedserve.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: 8000
applications:
  - name: pagedserve
    route_prefix: /
    import_path: serve_app:build_app
    args:
      {{- include "pagedserve.appArgs" . | nindent 6 }}
{{- end -}}
