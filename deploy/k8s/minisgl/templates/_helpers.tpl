{{- define "minisgl.name" -}}{{ .Release.Name }}-minisgl{{- end -}}
{{- define "minisgl.image" -}}
{{- $root := index . 0 -}}{{- $name := index . 1 -}}
{{- if $root.Values.image.registry -}}{{ $root.Values.image.registry }}/{{- end -}}minisgl/{{ $name }}:{{ $root.Values.image.tag }}
{{- end -}}
{{- define "minisgl.labels" -}}
app.kubernetes.io/name: minisgl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
{{- define "minisgl.grpcProbe" -}}
grpc: {port: {{ . }}}
periodSeconds: 5
failureThreshold: 6
{{- end -}}
{{- define "minisgl.modelVolume" -}}
{{- if .Values.model.pvc }}
- name: model
  persistentVolumeClaim: {claimName: {{ .Values.model.pvc }}, readOnly: true}
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
{{- end }}
{{- end -}}
