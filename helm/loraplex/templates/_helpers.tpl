{{/* Names. */}}
{{- define "loraplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loraplex.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels: common ones, then a component's selector labels. Call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "loraplex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "loraplex.labels" -}}
helm.sh/chart: {{ include "loraplex.chart" .ctx }}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: loraplex
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "loraplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "loraplex.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference. Call with (dict "image" .Values.gateway.image "ctx" $). */}}
{{- define "loraplex.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Object names. */}}
{{- define "loraplex.gateway.fullname" -}}{{ include "loraplex.fullname" . }}-gateway{{- end -}}
{{- /* The components deployed: no loraplex gateway behind an InferencePool. */ -}}
{{- define "loraplex.components" -}}{{ if .Values.inferencePool.enabled }}worker{{ else }}gateway worker{{ end }}{{- end -}}
{{- define "loraplex.pool.fullname" -}}{{ default (printf "%s-pool" (include "loraplex.fullname" .)) .Values.inferencePool.name }}{{- end -}}
{{- define "loraplex.worker.fullname" -}}{{ include "loraplex.fullname" . }}-worker{{- end -}}
{{- define "loraplex.redis.fullname" -}}{{ include "loraplex.fullname" . }}-redis{{- end -}}

{{/* The workers' headless Service DNS name with port: `loraplex gateway --workers`. */}}
{{- define "loraplex.workers.target" -}}
{{- printf "%s.%s.svc.%s:%d" (include "loraplex.worker.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.worker.port) -}}
{{- end -}}

{{/* Where the gateway mounts the API key Secret. */}}
{{- define "loraplex.apiKeysDir" -}}/etc/loraplex/api-keys{{- end -}}

{{/* The workers' `--model`. */}}
{{- define "loraplex.worker.model" -}}
{{- if has .Values.model.source (list "demo" "smollm2") -}}
{{ .Values.model.source }}
{{- else -}}
{{- printf "/models/%s" .Values.model.path | clean -}}
{{- end -}}
{{- end -}}

{{/*
The gateway's `--model`: a directory with the model's config.json. From model.configMap when
set, else from the model's PVC; the built-in models (demo, smollm2) need neither.
*/}}
{{- define "loraplex.gateway.model" -}}
{{- if has .Values.model.source (list "demo" "smollm2") -}}
{{ .Values.model.source }}
{{- else if .Values.model.configMap -}}
/etc/loraplex/model
{{- else if eq .Values.model.source "pvc" -}}
{{- include "loraplex.worker.model" . -}}
{{- else -}}
{{- fail "model.configMap is required when model.source is initContainer: the gateway needs the model's config.json" -}}
{{- end -}}
{{- end -}}

{{/* The Secret and key holding the Redis password (in-release Redis). */}}
{{- define "loraplex.redis.secretName" -}}
{{- default (include "loraplex.redis.fullname" .) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/*
Environment that names the adapter store for the gateway and the workers, from Secrets only.
In-release Redis: the password comes from its Secret and Kubernetes expands $(REDIS_PASSWORD)
into the URL, so neither the password nor the URL holding it is ever a plain value.
*/}}
{{- define "loraplex.storeEnv" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "loraplex.redis.secretName" . }}
      key: {{ .Values.redis.auth.secretKey }}
- name: LORAPLEX_STORE
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s.%s.svc.%s:%d/0" (include "loraplex.redis.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.redis.port) | quote }}
{{- else }}
- name: LORAPLEX_STORE
  valueFrom:
    secretKeyRef:
      name: {{ required "externalRedis.existingSecret is required when redis.enabled is false" .Values.externalRedis.existingSecret }}
      key: {{ .Values.externalRedis.secretKey }}
{{- end }}
{{- end -}}

{{/*
Flags from a values map, as ConfigMap entries: `maxNumSeqs: 256` becomes
`LORAPLEX_MAX_NUM_SEQS: "256"` (the environment half of `--max-num-seqs`). Null values are
left out, so the server's default applies.
*/}}
{{- define "loraplex.flagEnv" -}}
{{- range $key, $value := . }}
{{- if not (kindIs "invalid" $value) }}
{{ printf "LORAPLEX_%s" ($key | snakecase | upper) }}: {{ include "loraplex.scalar" $value | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A scalar as a flag reads it: strings as they are, numbers without an exponent. */}}
{{- define "loraplex.scalar" -}}
{{- if kindIs "string" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{/* The restricted-level container securityContext. */}}
{{- define "loraplex.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The restricted-level pod securityContext. Call with a podSecurity map. */}}
{{- define "loraplex.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .runAsUser }}
runAsGroup: {{ .runAsGroup }}
fsGroup: {{ .fsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* A gRPC probe. Call with (dict "port" 50051 "service" "" "probe" .Values.x.probes.readiness). */}}
{{- define "loraplex.grpcProbe" -}}
grpc:
  port: {{ .port }}
  service: {{ .service | quote }}
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end -}}

{{/* An HTTP probe on the metrics port. Call with (dict "port" 9400 "probe" .Values.x.probes.liveness). */}}
{{- define "loraplex.httpProbe" -}}
httpGet:
  port: {{ .port }}
  path: /metrics
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end -}}

{{/* The command line of a loraplex server: the global flags, then the subcommand's. */}}
{{- define "loraplex.args" -}}
- --log-level
- {{ .ctx.Values.logLevel | quote }}
- {{ .command }}
{{- range .extra }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Refuse a termination grace period shorter than the preStop sleep plus the drain. */}}
{{- define "loraplex.checkGrace" -}}
{{- $need := add .preStop .drain 5 -}}
{{- if lt (int .grace) (int $need) -}}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must be at least preStopSleepSeconds + config.drainGrace + 5 = %d" .component (int .grace) (int $need)) -}}
{{- end -}}
{{- end -}}
