{{/* Names, labels and the pieces every template shares. */}}

{{- define "moe-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name; object names add "-<component>", so it stays
     short enough for pool StatefulSet pod names (see values.schema.json). */}}
{{- define "moe-serve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 24 | trimSuffix "-" -}}
{{- else if contains (include "moe-serve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 24 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "moe-serve.name" .) | trunc 24 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "moe-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moe-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "moe-serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "moe-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: moe-serve
{{- end -}}

{{- define "moe-serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "moe-serve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image: (dict "img" .Values.image "root" $) */}}
{{- define "moe-serve.image" -}}
{{- printf "%s:%s" .img.repository (default .root.Chart.AppVersion .img.tag) -}}
{{- end -}}

{{/* The etcd client URLs every process gets with --etcd. */}}
{{- define "moe-serve.etcdEndpoints" -}}
{{- if .Values.etcd.external.endpoints -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- $full := include "moe-serve.fullname" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $urls = append $urls (printf "http://%s-etcd-%d.%s-etcd-headless.%s.svc.%s:%d" $full $i $full $.Release.Namespace $.Values.clusterDomain (int $.Values.etcd.clientPort)) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}
{{- end -}}

{{/* The coordinator Service's in-cluster address (gRPC). */}}
{{- define "moe-serve.coordinatorAddr" -}}
{{- printf "%s-coordinator.%s.svc.%s:%d" (include "moe-serve.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.coordinator.grpcPort) -}}
{{- end -}}

{{/* Pod spec pieces shared by every pod of the release. */}}
{{- define "moe-serve.podCommon" -}}
serviceAccountName: {{ include "moe-serve.serviceAccountName" . }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* TLS and tokens (README "Security"): the Secrets (given, or generated
     once by security-secrets.yaml), the name every certificate carries, and
     the flags. Workers get the certificate (mutual TLS between coordinators,
     workers and the KV data plane); coordinators also the token files. */}}
{{- define "moe-serve.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "moe-serve.fullname" .)) .Values.tls.secretName -}}
{{- end -}}
{{- define "moe-serve.authSecretName" -}}
{{- default (printf "%s-auth" (include "moe-serve.fullname" .)) .Values.auth.secretName -}}
{{- end -}}
{{- define "moe-serve.tlsServerName" -}}
{{- default (printf "%s.%s.svc" (include "moe-serve.fullname" .) .Release.Namespace) .Values.tls.serverName -}}
{{- end -}}

{{- define "moe-serve.securityArgs" -}}
{{- $root := .root -}}
{{- if and $root.Values.auth.enabled (eq .component "coordinator") }}
- --api-token-file
- /etc/moe-serve/auth/token
- --admin-token-file
- /etc/moe-serve/auth/admin-token
{{- end }}
{{- if $root.Values.tls.enabled }}
- --tls-dir
- /etc/moe-serve/tls
- --tls-server-name
- {{ include "moe-serve.tlsServerName" $root | quote }}
{{- end }}
{{- end -}}

{{/* A health probe on a gRPC port: Kubernetes' own gRPC probe (plaintext),
     or with TLS `moectl health` inside the container (TLS, the pod's
     certificate for the workers' mutual TLS; health needs no token).
     Args: root, port, service. */}}
{{- define "moe-serve.healthProbe" -}}
{{- if .root.Values.tls.enabled }}
exec:
  command: [moectl, --addr, "127.0.0.1:{{ .port }}", --tls-dir, /etc/moe-serve/tls, --tls-server-name, {{ include "moe-serve.tlsServerName" .root | quote }}, --timeout-ms, "3000", health, {{ .service | quote }}]
{{- else }}
grpc:
  port: {{ .port }}
  service: {{ .service | quote }}
{{- end }}
{{- end -}}

{{- define "moe-serve.securityMounts" -}}
{{- $root := .root -}}
{{- if and $root.Values.auth.enabled (eq .component "coordinator") }}
- name: api-token
  mountPath: /etc/moe-serve/auth
  readOnly: true
{{- end }}
{{- if $root.Values.tls.enabled }}
- name: tls
  mountPath: /etc/moe-serve/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "moe-serve.securityVolumes" -}}
{{- $root := .root -}}
{{- if and $root.Values.auth.enabled (eq .component "coordinator") }}
- name: api-token
  secret:
    secretName: {{ include "moe-serve.authSecretName" $root }}
    defaultMode: 0440
{{- end }}
{{- if $root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "moe-serve.tlsSecretName" $root }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "moe-serve.modelMount" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "moe-serve.modelVolume" -}}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The downward-API env every server process uses in its arguments. */}}
{{- define "moe-serve.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/* Checks that JSON schema cannot express; each failure names the value. */}}
{{- define "moe-serve.validate" -}}
{{- $names := dict -}}
{{- $roles := dict -}}
{{- range $i, $p := .Values.pools -}}
{{- if hasKey $names $p.name -}}
{{- fail (printf "pools[%d].name: '%s' is used by another pool; pool names must be unique" $i $p.name) -}}
{{- end -}}
{{- $_ := set $names $p.name true -}}
{{- $_ := set $roles (default "mixed" $p.role) true -}}
{{- $ranks := int (default 1 $p.ranksPerGroup) -}}
{{- $pods := int (default 1 $p.podsPerGroup) -}}
{{- $tp := int (default 1 $p.tp) -}}
{{- if ne (mod $ranks $pods) 0 -}}
{{- fail (printf "pools[%d].ranksPerGroup (%d) is not a multiple of pools[%d].podsPerGroup (%d): every pod of a group runs the same number of ranks" $i $ranks $i $pods) -}}
{{- end -}}
{{- if ne (mod $ranks $tp) 0 -}}
{{- fail (printf "pools[%d].tp (%d) does not divide pools[%d].ranksPerGroup (%d)" $i $tp $i $ranks) -}}
{{- end -}}
{{- if $p.dpAttention -}}
{{- if le $ranks $tp -}}
{{- fail (printf "pools[%d].dpAttention needs ranksPerGroup (%d) > tp (%d), i.e. two DP groups or more" $i $ranks $tp) -}}
{{- end -}}
{{- end -}}
{{- with $p.placement -}}
{{- if and (hasKey . "n_rank") (ne (int .n_rank) $ranks) -}}
{{- fail (printf "pools[%d].placement.n_rank (%d) differs from pools[%d].ranksPerGroup (%d)" $i (int .n_rank) $i $ranks) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (hasKey $roles "prefill") (not (hasKey $roles "decode")) -}}
{{- fail "pools: a pool with role prefill needs a pool with role decode to hand its requests to" -}}
{{- end -}}
{{- if and (hasKey $roles "decode") (not (hasKey $roles "prefill")) -}}
{{- fail "pools: a pool with role decode needs a pool with role prefill (or use role mixed)" -}}
{{- end -}}
{{- if le (int .Values.worker.terminationGracePeriodSeconds) (int .Values.worker.drainTimeoutSeconds) -}}
{{- fail (printf "worker.terminationGracePeriodSeconds (%d) must exceed worker.drainTimeoutSeconds (%d), or the kubelet kills a draining worker" (int .Values.worker.terminationGracePeriodSeconds) (int .Values.worker.drainTimeoutSeconds)) -}}
{{- end -}}
{{- if le (int .Values.coordinator.terminationGracePeriodSeconds) (add (int .Values.coordinator.graceSeconds) (int .Values.coordinator.preStopSeconds)) -}}
{{- fail (printf "coordinator.terminationGracePeriodSeconds (%d) must exceed coordinator.graceSeconds + coordinator.preStopSeconds (%d)" (int .Values.coordinator.terminationGracePeriodSeconds) (add (int .Values.coordinator.graceSeconds) (int .Values.coordinator.preStopSeconds))) -}}
{{- end -}}
{{- if and .Values.model.volume (not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) .Values.model.path)) -}}
{{- fail (printf "model.path (%s) must be under model.mountPath (%s) when model.volume is set" .Values.model.path .Values.model.mountPath) -}}
{{- end -}}

{{- if and .Values.benchmark.enabled (eq .Values.benchmark.backend "openai") (not .Values.coordinator.http.enabled) -}}
{{- fail "benchmark.backend: openai needs coordinator.http.enabled (the OpenAI-compatible port)" -}}
{{- end -}}
{{- if and (eq .Values.benchmark.kind "mpijob") .Values.benchmark.enabled (not (.Capabilities.APIVersions.Has "kubeflow.org/v2beta1/MPIJob")) -}}
{{- fail "benchmark.kind: mpijob needs the MPIJob CRD (kubeflow.org/v2beta1) in the cluster; install the mpi-operator or use kind job" -}}
{{- end -}}
{{- end -}}

{{/* An init container that waits for etcd (the processes exit when it is
     unreachable at start). */}}
{{- define "moe-serve.waitEtcd" -}}
- name: wait-etcd
  image: {{ .image }}
  imagePullPolicy: {{ .pullPolicy }}
  command: [moe-wait-etcd, {{ include "moe-serve.etcdEndpoints" .root | quote }}, "600"]
  securityContext:
    {{- toYaml .root.Values.containerSecurityContext | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 64Mi}
{{- end -}}

{{/* The effective settings of pool .pool: its own values over worker.* */}}
{{- define "moe-serve.pool" -}}
{{- $w := .root.Values.worker -}}
{{- $p := .pool -}}
{{- $ranks := int (default 1 $p.ranksPerGroup) -}}
{{- $pods := int (default 1 $p.podsPerGroup) -}}
{{- $gpus := int (default 0 $p.gpusPerRank) -}}
{{- $device := $w.device -}}
{{- if and (gt $gpus 0) (eq $device "auto") -}}{{- $device = "cuda" -}}{{- end -}}
{{- $img := ternary .root.Values.cudaImage .root.Values.image (gt $gpus 0) -}}
{{- $res := deepCopy (default dict $p.resources) -}}
{{- if gt $gpus 0 -}}
{{- $lim := default dict $res.limits -}}
{{- $_ := set $lim "nvidia.com/gpu" (mul $gpus (div $ranks $pods)) -}}
{{- $_ := set $res "limits" $lim -}}
{{- end -}}
{{- toJson (dict
  "name" $p.name
  "fullName" (printf "%s-%s" (include "moe-serve.fullname" .root) $p.name)
  "role" (default "mixed" $p.role)
  "replicas" (int (default 1 $p.replicas))
  "ranks" $ranks
  "pods" $pods
  "ranksPerPod" (div $ranks $pods)
  "tp" (int (default 1 $p.tp))
  "dpAttention" (default false $p.dpAttention)
  "gpusPerRank" $gpus
  "device" (default $device $p.device)
  "dtype" (default $w.dtype $p.dtype)
  "kvDtype" (default (default "auto" $w.kvDtype) $p.kvDtype)
  "threads" (int (default $w.threads $p.threads))
  "kvMemoryMiB" (int (default $w.kvMemoryMiB $p.kvMemoryMiB))
  "specTokens" (int (default (default 0 $w.specTokens) $p.specTokens))
  "draftModel" (default (default "" $w.draftModel) $p.draftModel)
  "image" (include "moe-serve.image" (dict "img" $img "root" .root))
  "pullPolicy" $img.pullPolicy
  "resources" $res
  "nodeSelector" (default dict $p.nodeSelector)
  "tolerations" (default list $p.tolerations)
  "affinity" (default dict $p.affinity)
  "placement" (default dict $p.placement)
  "extraArgs" (concat (default list $w.extraArgs) (default list $p.extraArgs))
  "env" (concat (default list $w.env) (default list $p.env))
  "podAnnotations" (merge (default dict $p.podAnnotations) (default dict $w.podAnnotations))
) -}}
{{- end -}}

{{/* moe-worker's arguments for pool .p (the output of moe-serve.pool). */}}
{{- define "moe-serve.workerArgs" -}}
{{- $w := .root.Values.worker -}}
{{- $p := .p -}}
- moe-worker
- --model
- {{ .root.Values.model.path | quote }}
- --listen
- "0.0.0.0:{{ $w.grpcPort }}"
- --advertise
- "$(POD_IP):{{ $w.grpcPort }}"
- --worker-id
- "$(POD_NAME)"
- --etcd
- {{ include "moe-serve.etcdEndpoints" .root | quote }}
- --lease-ttl
- {{ $w.leaseTTLSeconds | quote }}
- --role
- {{ $p.role }}
- --device
- {{ $p.device }}
- --dtype
- {{ $p.dtype }}
- --threads
- {{ $p.threads | quote }}
- --kv-memory
- {{ $p.kvMemoryMiB | quote }}
{{- if ne $p.kvDtype "auto" }}
- --kv-dtype
- {{ $p.kvDtype }}
{{- end }}
{{- if gt (int $p.specTokens) 0 }}
- --spec-tokens
- {{ $p.specTokens | quote }}
{{- if $p.draftModel }}
- --draft-model
- {{ $p.draftModel | quote }}
{{- end }}
{{- end }}
- --drain-timeout
- {{ $w.drainTimeoutSeconds | quote }}
- --tp
- {{ $p.tp | quote }}
{{- if $p.dpAttention }}
- --dp-attention
{{- end }}
{{- if $p.placement }}
- --placement
- /etc/moe-serve/placement/{{ $p.name }}.json
{{- end }}
{{- if $w.metrics.enabled }}
- --metrics-listen
- "0.0.0.0:{{ $w.metrics.port }}"
{{- end }}
{{- include "moe-serve.securityArgs" (dict "root" .root "component" "worker") }}
{{- range $p.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The pod spec of a group's serving pod (kind: single = the whole group in
     this pod under mpirun; leader = rank 0's pod of a multi-pod group) or of
     a follower pod of a multi-pod group. */}}
{{- define "moe-serve.workerPodSpec" -}}
{{- $root := .root -}}
{{- $w := $root.Values.worker -}}
{{- $p := .p -}}
{{- include "moe-serve.podCommon" $root }}
terminationGracePeriodSeconds: {{ $w.terminationGracePeriodSeconds }}
{{- if ne .kind "follower" }}
initContainers:
  {{- include "moe-serve.waitEtcd" (dict "root" $root "image" $p.image "pullPolicy" $p.pullPolicy) | nindent 2 }}
{{- end }}
containers:
  - name: {{ ternary "follower" "worker" (eq .kind "follower") }}
    image: {{ $p.image }}
    imagePullPolicy: {{ $p.pullPolicy }}
    {{- if eq .kind "single" }}
    # tini as PID 1 reaps what mpirun's ranks leave behind
    command:
      - tini
      - --
      - mpirun
      {{- range $w.mpirunArgs }}
      - {{ . | quote }}
      {{- end }}
      - -np
      - {{ $p.ranks | quote }}
      - moe-rank
    args:
      {{- include "moe-serve.workerArgs" . | nindent 6 }}
    {{- else if eq .kind "leader" }}
    command: [tini, --, moe-group, leader, --]
    args:
      {{- include "moe-serve.workerArgs" . | nindent 6 }}
    {{- else }}
    command: [tini, --, moe-group, follower]
    {{- end }}
    env:
      {{- include "moe-serve.podEnv" $root | nindent 6 }}
      - name: MOE_GPUS_PER_RANK
        value: {{ $p.gpusPerRank | quote }}
      {{- if ne .kind "single" }}
      - name: MOE_RANKS_PER_POD
        value: {{ $p.ranksPerPod | quote }}
      - name: MOE_MPIRUN_ARGS
        value: {{ join " " $w.mpirunArgs | quote }}
      - name: MOE_GROUP_WAIT_S
        value: {{ $w.groupWaitSeconds | quote }}
      - name: MOE_SSH_KEY
        value: /etc/moe-serve/ssh/ssh-privatekey
      {{- end }}
      {{- if .sts }}
      - name: MOE_FOLLOWER_STS
        value: {{ $p.fullName }}-follower
      - name: MOE_FOLLOWER_SVC
        value: {{ printf "%s-workers.%s.svc.%s" $p.fullName $root.Release.Namespace $root.Values.clusterDomain }}
      - name: MOE_PODS_PER_GROUP
        value: {{ $p.pods | quote }}
      {{- end }}
      {{- with $p.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    ports:
      {{- if ne .kind "follower" }}
      - name: grpc
        containerPort: {{ $w.grpcPort }}
        protocol: TCP
      {{- if $w.metrics.enabled }}
      - name: metrics
        containerPort: {{ $w.metrics.port }}
        protocol: TCP
      {{- end }}
      {{- end }}
      {{- if ne .kind "single" }}
      - name: ssh
        containerPort: 2222
        protocol: TCP
      {{- end }}
    {{- if eq .kind "follower" }}
    readinessProbe:
      tcpSocket:
        port: ssh
      periodSeconds: 5
    livenessProbe:
      tcpSocket:
        port: ssh
      periodSeconds: 10
      failureThreshold: 6
    lifecycle:
      preStop:
        exec:
          command: [moe-prestop, follower, {{ $w.drainTimeoutSeconds | quote }}]
    {{- else }}
    startupProbe:
      {{- include "moe-serve.healthProbe" (dict "root" .root "port" $w.grpcPort "service" "") | nindent 6 }}
      periodSeconds: 5
      failureThreshold: {{ max 1 (div $w.startupTimeoutSeconds 5) }}
    readinessProbe:
      {{- include "moe-serve.healthProbe" (dict "root" .root "port" $w.grpcPort "service" "moe.v1.Worker") | nindent 6 }}
      periodSeconds: 5
      failureThreshold: 2
    livenessProbe:
      {{- include "moe-serve.healthProbe" (dict "root" .root "port" $w.grpcPort "service" "") | nindent 6 }}
      periodSeconds: 10
      timeoutSeconds: 5
      failureThreshold: 6
    lifecycle:
      preStop:
        exec:
          command: [moe-prestop, worker, {{ $w.drainTimeoutSeconds | quote }}]
    {{- end }}
    resources:
      {{- toYaml $p.resources | nindent 6 }}
    securityContext:
      {{- toYaml $root.Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      - name: shm
        mountPath: /dev/shm
      - name: tmp
        mountPath: /tmp
      {{- if $p.placement }}
      - name: placement
        mountPath: /etc/moe-serve/placement
        readOnly: true
      {{- end }}
      {{- if ne .kind "single" }}
      - name: ssh-key
        mountPath: /etc/moe-serve/ssh
        readOnly: true
      {{- end }}
      {{- with include "moe-serve.modelMount" $root }}{{ . | trim | nindent 6 }}{{- end }}
      {{- with include "moe-serve.securityMounts" (dict "root" $root "component" "worker") }}{{ . | trim | nindent 6 }}{{- end }}
volumes:
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $w.shmSizeLimit }}
  - name: tmp
    emptyDir: {}
  {{- if $p.placement }}
  - name: placement
    configMap:
      name: {{ include "moe-serve.fullname" $root }}-placement
  {{- end }}
  {{- if ne .kind "single" }}
  - name: ssh-key
    secret:
      secretName: {{ include "moe-serve.sshSecretName" $root }}
      defaultMode: 0440
  {{- end }}
  {{- with include "moe-serve.modelVolume" $root }}{{ . | trim | nindent 2 }}{{- end }}
  {{- with include "moe-serve.securityVolumes" (dict "root" $root "component" "worker") }}{{ . | trim | nindent 2 }}{{- end }}
{{- with $p.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $p.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $p.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "moe-serve.sshSecretName" -}}
{{- default (printf "%s-ssh" (include "moe-serve.fullname" .)) .Values.ssh.existingSecret -}}
{{- end -}}

{{- define "moe-serve.poolLabels" -}}
{{ include "moe-serve.labels" .root }}
app.kubernetes.io/component: worker
moe-serve.io/pool: {{ .p.name }}
moe-serve.io/role: {{ .p.role }}
{{- end -}}

{{- define "moe-serve.poolSelector" -}}
{{ include "moe-serve.selectorLabels" .root }}
app.kubernetes.io/component: worker
moe-serve.io/pool: {{ .p.name }}
{{- end -}}

{{/* moe-bench and its arguments (benchmark.*); with auth and TLS on, the
     API token and the CA (the bench pods mount both). */}}
{{- define "moe-serve.benchArgs" -}}
- moe-bench
- --backend
- {{ .b.backend }}
- --base-url
- {{ .target | quote }}
{{- if .root.Values.auth.enabled }}
- --token-file
- /etc/moe-serve/auth/token
{{- end }}
{{- if .root.Values.tls.enabled }}
- --tls-ca
- /etc/moe-serve/tls/ca.crt
- --tls-server-name
- {{ include "moe-serve.tlsServerName" .root | quote }}
{{- end }}
{{- range .b.args }}
- {{ . | quote }}
{{- end }}
{{- end -}}
