{{/*
Cross-field checks that values.schema.json cannot express. Each failure names the keys and says
what to change; rayservice.yaml includes this before it renders anything.
*/}}
{{- define "pagedserve.validate" -}}
{{- $tp := .Values.tensorParallelSize | int -}}
{{- $gpus := include "pagedserve.gpusPerPod" . | int -}}
{{- if ne (mod $gpus $tp) 0 -}}
{{- fail (printf "tensorParallelSize (%d) must divide gpuWorkers.gpusPerPod (%d): each Worker replica needs all %d of its GPUs on one node, so a pod holds a whole number of replicas" $tp $gpus $tp) -}}
{{- end -}}

{{- if and .Values.autoscaling.inline (ne .Values.autoscaling.policy "inline") -}}
{{- fail (printf "autoscaling.inline is set but autoscaling.policy is %q; set autoscaling.policy to \"inline\" to use it" .Values.autoscaling.policy) -}}
{{- end -}}
{{- $min := include "pagedserve.minReplicas" . | int -}}
{{- $max := include "pagedserve.maxReplicas" . | int -}}
{{- if gt $min $max -}}
{{- fail (printf "autoscaling: min_replicas (%d) is above max_replicas (%d); the Worker replica bounds need min <= max" $min $max) -}}
{{- end -}}

{{- $workerCpus := .Values.app.worker_num_cpus | default 1.0 | float64 -}}
{{- $needCpus := mulf $workerCpus $gpus -}}
{{- if lt (.Values.gpuWorkers.cpu | float64) $needCpus -}}
{{- fail (printf "gpuWorkers.cpu (%v) is below gpuWorkers.gpusPerPod x app.worker_num_cpus (%d x %v = %v): Ray reserves app.worker_num_cpus CPUs for every tensor-parallel rank, so a full pod of Worker replicas would never fit" .Values.gpuWorkers.cpu $gpus $workerCpus $needCpus) -}}
{{- end -}}

{{- range $key := list "model" "engine" "tensor_parallel_size" "autoscaling" "accelerator" "api_key" "api_key_file" "num_workers" -}}
{{- if hasKey $.Values.app $key -}}
{{- fail (printf "app.%s is set by the chart; use %s instead" $key (get (dict "model" "model.source and model.path" "engine" "flat engine keys in app (dtype, max_model_len, ...)" "tensor_parallel_size" "tensorParallelSize" "autoscaling" "autoscaling.policy" "accelerator" "gpuWorkers (Workers always ask Ray for GPUs here)" "api_key" "apiKey (a Secret, never a plain value in the RayService)" "api_key_file" "apiKey" "num_workers" "autoscaling.minReplicas/maxReplicas") $key)) -}}
{{- end -}}
{{- end -}}

{{- if eq .Values.model.source "download" -}}
{{- range .Values.model.download.allowPatterns -}}
{{- if or (hasSuffix ".py" .) (eq . "*") (eq . "*.*") -}}
{{- fail (printf "model.download.allowPatterns: %q would fetch Python files; pagedserve never runs a checkpoint's code, so list only config, tokenizer and *.safetensors files" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- if and (has .Values.service.type (list "NodePort" "LoadBalancer")) (not .Values.apiKey.enabled) (not .Values.service.allowUnauthenticated) -}}
{{- fail (printf "service.type is %s and apiKey.enabled is false: port 8000 would answer anyone who reaches a node or the load balancer, with no key. Set apiKey.enabled=true (the Router then requires a bearer key), or service.allowUnauthenticated=true where something else keeps strangers out (a private network, an authenticating proxy), or keep service.type ClusterIP" .Values.service.type) -}}
{{- end -}}

{{- if and .Values.apiKey.enabled .Values.apiKey.existingSecret .Values.apiKey.value -}}
{{- fail "apiKey: set either existingSecret or value, not both" -}}
{{- end -}}

{{- $paths := list "/dev/shm" (include "pagedserve.apiKeyMountPath" .) (trimSuffix "/" .Values.model.mountPath) -}}
{{- range $role := list "head" "gpuWorkers" -}}
{{- $v := index $.Values $role -}}
{{- range $v.volumes -}}
{{- if has .name (list "dshm" "model" "api-key") -}}
{{- fail (printf "%s.volumes: %q is a volume the chart makes (dshm, model, api-key); give yours another name" $role .name) -}}
{{- end -}}
{{- end -}}
{{- range $v.volumeMounts -}}
{{- if has (trimSuffix "/" .mountPath) $paths -}}
{{- fail (printf "%s.volumeMounts: %q is where the chart mounts /dev/shm, the weights (model.mountPath) or the API key; mount yours elsewhere" $role .mountPath) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
