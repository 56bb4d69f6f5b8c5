{{- define "minisgl.name" -}}{{ .Release.Name }}-minisgl{{- end -}}

{{/* (list $ "gateway") -> registry/repository/gateway:tag */}}
{{- define "minisgl.image" -}}
{{- $root := index . 0 -}}{{- $name := index . 1 -}}
{{- $img := $root.Values.image -}}
{{- if $img.registry -}}{{ $img.registry }}/{{- end -}}
{{- if $img.repository -}}{{ $img.repository }}/{{- end -}}
{{ $name }}:{{ $img.tag | default $root.Chart.AppVersion }}
{{- end -}}

{{- define "minisgl.labels" -}}
app.kubernetes.io/name: minisgl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{/* (list $ "gateway") */}}
{{- define "minisgl.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "minisgl.tokenSecret" -}}
{{- .Values.security.internalToken.existingSecret | default (printf "%s-internal-token" (include "minisgl.name" .)) -}}
{{- end -}}

{{/* Probes of gRPC health: the kubelet's own gRPC probe against the pod IP, or (mTLS, or
     probes.exec) `python -m minisgl_core.healthcheck` inside the container on loopback.
     (list $ port settingsDict) */}}
{{- define "minisgl.grpcProbe" -}}
{{- $root := index . 0 -}}{{- $port := index . 1 -}}{{- $s := index . 2 -}}
{{- if or $root.Values.probes.exec $root.Values.security.mtls.enabled -}}
exec:
  command: [python, -m, minisgl_core.healthcheck, grpc, "127.0.0.1:{{ $port }}", --timeout, "{{ sub ($s.timeoutSeconds | default 2) 1 | max 1 }}"]
{{- else -}}
grpc: {port: {{ $port }}}
{{- end }}
{{- range $k, $v := $s }}
{{ $k }}: {{ $v }}
{{- end }}
{{- end -}}

{{/* Placement and pod-wide settings. (list $ tierValues) */}}
{{- define "minisgl.podSpec" -}}
{{- $root := index . 0 -}}{{- $t := index . 1 -}}
automountServiceAccountToken: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($t.nodeSelector | default $root.Values.nodeSelector) }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($t.tolerations | default $root.Values.tolerations) }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($t.affinity | default $root.Values.affinity) }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($t.runtimeClassName | default $root.Values.runtimeClassName) }}
runtimeClassName: {{ . }}
{{- end }}
{{- with ($t.priorityClassName | default $root.Values.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* Environment of every container: log level, metrics compatibility names, internal token /
    mTLS (or --insecure where both are off on purpose), a writable HOME. */}}
{{- define "minisgl.env" -}}
- {name: MINISGL_LOG_LEVEL, value: {{ .Values.logLevel | quote }}}
- {name: HOME, value: /tmp}
{{- if ne .Values.metrics.compat "off" }}
- {name: MINISGL_METRICS_COMPAT, value: {{ .Values.metrics.compat | quote }}}
{{- end }}
{{- if .Values.security.internalToken.enabled }}
- {name: MINISGL_INTERNAL_TOKEN_FILE, value: /etc/minisgl/internal-token/token}
{{- end }}
{{- if .Values.security.mtls.enabled }}
- {name: MINISGL_INTERNAL_TLS_DIR, value: /etc/minisgl/tls}
{{- end }}
{{- if not (or .Values.security.internalToken.enabled .Values.security.mtls.enabled) }}
{{- if not .Values.security.insecure }}
{{- fail "security: internalToken and mtls are both off; the internal services would serve anyone on the pod network (set security.insecure=true if that is intended)" }}
{{- end }}
{{- range list "TOKENIZER" "DETOKENIZER" "SCHEDULER" "WORKER" }}
- {name: MINISGL_{{ . }}_INSECURE, value: "1"}
{{- end }}
{{- end }}
{{- end -}}

{{- define "minisgl.mounts" -}}
- {name: tmp, mountPath: /tmp}
{{- if .Values.security.internalToken.enabled }}
- {name: internal-token, mountPath: /etc/minisgl/internal-token, readOnly: true}
{{- end }}
{{- if .Values.security.mtls.enabled }}
- {name: internal-tls, mountPath: /etc/minisgl/tls, readOnly: true}
{{- end }}
{{- end -}}

{{- define "minisgl.volumes" -}}
- {name: tmp, emptyDir: {sizeLimit: 1Gi}}
{{- if .Values.security.internalToken.enabled }}
- name: internal-token
  secret: {secretName: {{ include "minisgl.tokenSecret" . }}, defaultMode: 0440}
{{- end }}
{{- if .Values.security.mtls.enabled }}
- name: internal-tls
  secret: {secretName: {{ required "security.mtls.secretName is required with mTLS" .Values.security.mtls.secretName }}, defaultMode: 0440}
{{- end }}
{{- end -}}

{{/* The model directory: a read-only PVC, or an emptyDir the init container fills. */}}
{{- define "minisgl.modelVolume" -}}
{{- if .Values.model.pvc }}
- name: model
  persistentVolumeClaim: {claimName: {{ .Values.model.pvc }}, readOnly: true}
{{- else if .Values.model.initContainer.enabled }}
- name: model
  emptyDir: {sizeLimit: {{ .Values.model.initContainer.sizeLimit }}}
{{- end }}
{{- end -}}

{{- define "minisgl.modelMount" -}}
{{- if .Values.model.pvc }}
- name: model
  mountPath: {{ .Values.model.path }}
  readOnly: true
  {{- with .Values.model.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- else if .Values.model.initContainer.enabled }}
- {name: model, mountPath: {{ .Values.model.path }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "minisgl.modelInit" -}}
{{- if and .Values.model.initContainer.enabled (not .Values.model.pvc) }}
initContainers:
  - name: fetch-model
    image: {{ .Values.model.initContainer.image | default (include "minisgl.image" (list . "tokenizer")) }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: {{- toYaml (required "model.initContainer.command is required" .Values.model.initContainer.command) | nindent 6 }}
    env: {{- include "minisgl.env" . | nindent 6 }}
    securityContext: {{- toYaml .Values.securityContext | nindent 6 }}
    resources: {{- toYaml .Values.model.initContainer.resources | nindent 6 }}
    volumeMounts:
      - {name: tmp, mountPath: /tmp}
      - {name: model, mountPath: {{ .Values.model.path }}}
{{- end }}
{{- end -}}

{{/* preStop: wait so that endpoints drop the pod before SIGTERM. */}}
{{- define "minisgl.preStopSleep" -}}
preStop:
  exec:
    command: [python, -c, "import time; time.sleep({{ . }})"]
{{- end -}}
