{{/* Names: DNS labels are capped at 63 characters. */}}
{{- define "sluicegate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sluicegate.fullname" -}}
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

{{- define "sluicegate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sluicegate.labels" -}}
helm.sh/chart: {{ include "sluicegate.chart" . }}
app.kubernetes.io/name: {{ include "sluicegate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluicegate
{{- end }}

{{/* Selector labels for one component: pass (dict "root" $ "component" "gateway"). */}}
{{- define "sluicegate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluicegate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "sluicegate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sluicegate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sluicegate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "sluicegate.engineImage" -}}
{{- $repository := default .Values.image.repository .Values.engineImage.repository }}
{{- $tag := default (printf "%s-engine" (default .Chart.AppVersion .Values.image.tag)) .Values.engineImage.tag }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{/* The Secret the chart renders from values (master key, URLs given as values). */}}
{{- define "sluicegate.secretName" -}}
{{- include "sluicegate.fullname" . }}
{{- end }}

{{- define "sluicegate.postgresqlHost" -}}
{{- printf "%s-postgresql" (include "sluicegate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sluicegate.redisHost" -}}
{{- printf "%s-redis" (include "sluicegate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Where each secret value comes from: {"name": secret, "key": key}. A value the user gave
lands in the chart's own Secret; an existingSecret is referenced as is. Rendering fails with
a clear message when neither is set, so a broken release never starts.
*/}}
{{- define "sluicegate.masterKeyRef" -}}
{{- if .Values.masterKey.existingSecret }}
{{- dict "name" .Values.masterKey.existingSecret "key" .Values.masterKey.existingSecretKey | toJson }}
{{- else if .Values.masterKey.value }}
{{- dict "name" (include "sluicegate.secretName" .) "key" "master-key" | toJson }}
{{- else }}
{{- fail "masterKey: set masterKey.value or masterKey.existingSecret (the chart never generates one, so upgrades keep the same key)" }}
{{- end }}
{{- end }}

{{- define "sluicegate.databaseUrlRef" -}}
{{- if .Values.postgresql.enabled }}
{{- if not .Values.postgresql.auth.password }}
{{- fail "postgresql.auth.password: set it when postgresql.enabled is true" }}
{{- end }}
{{- dict "name" (include "sluicegate.secretName" .) "key" "database-url" | toJson }}
{{- else if .Values.database.existingSecret }}
{{- dict "name" .Values.database.existingSecret "key" .Values.database.existingSecretKey | toJson }}
{{- else if .Values.database.url }}
{{- dict "name" (include "sluicegate.secretName" .) "key" "database-url" | toJson }}
{{- else }}
{{- fail "database: set database.url or database.existingSecret, or enable the bundled postgresql" }}
{{- end }}
{{- end }}

{{- define "sluicegate.redisUrlRef" -}}
{{- if .Values.redisBundled.enabled }}
{{- dict "name" (include "sluicegate.secretName" .) "key" "redis-url" | toJson }}
{{- else if .Values.redis.existingSecret }}
{{- dict "name" .Values.redis.existingSecret "key" .Values.redis.existingSecretKey | toJson }}
{{- else if .Values.redis.url }}
{{- dict "name" (include "sluicegate.secretName" .) "key" "redis-url" | toJson }}
{{- else }}
{{- fail "redis: set redis.url or redis.existingSecret, or enable redisBundled" }}
{{- end }}
{{- end }}

{{/* The database URL as the chart renders it (bundled or given as a value); "" otherwise. */}}
{{- define "sluicegate.databaseUrlValue" -}}
{{- if .Values.postgresql.enabled }}
{{- $auth := .Values.postgresql.auth }}
{{- printf "postgresql+asyncpg://%s:%s@%s:5432/%s" (urlquery $auth.username) (urlquery $auth.password) (include "sluicegate.postgresqlHost" .) $auth.database }}
{{- else if not .Values.database.existingSecret }}
{{- .Values.database.url }}
{{- end }}
{{- end }}

{{- define "sluicegate.redisUrlValue" -}}
{{- if .Values.redisBundled.enabled }}
{{- printf "redis://%s:6379/0" (include "sluicegate.redisHost" .) }}
{{- else if not .Values.redis.existingSecret }}
{{- .Values.redis.url }}
{{- end }}
{{- end }}

{{/*
A number as a command-line argument or env value. Helm hands values over as float64, whose
default printing turns 1048576 into 1.048576e+06: whole numbers print as integers instead.
*/}}
{{- define "sluicegate.number" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}
{{- int64 . }}
{{- else }}
{{- . }}
{{- end }}
{{- end }}

{{- define "sluicegate.secretEnvVar" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .ref.name }}
      key: {{ .ref.key }}
{{- end }}

{{/* Environment the gateway and the engine share: Redis by reference, OTel. */}}
{{- define "sluicegate.commonEnv" -}}
{{- $root := .root }}
{{ include "sluicegate.secretEnvVar" (dict "name" "SLUICEGATE_REDIS_URL" "ref" (include "sluicegate.redisUrlRef" $root | fromJson)) }}
{{- if $root.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $root.Values.otel.endpoint | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "%s-%s" $root.Values.otel.serviceNamePrefix .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=%s,service.version=%s,k8s.namespace.name=%s" $root.Release.Name $root.Chart.AppVersion $root.Release.Namespace | quote }}
{{- range $name, $value := $root.Values.otel.extraEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sluicegate.metricsAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/*
Blocks until the database accepts TCP connections, at most waitTimeoutSeconds. Uses the
Sluicegate image's own Python and SQLAlchemy to parse the URL, so any URL form it accepts works.
*/}}
{{- define "sluicegate.waitForDatabaseScript" -}}
import os, socket, sys, time
from sqlalchemy.engine import make_url
url = make_url(os.environ["SLUICEGATE_DATABASE_URL"])
host, port = url.host or "localhost", url.port or 5432
deadline = time.monotonic() + float(os.environ["WAIT_TIMEOUT_SECONDS"])
while True:
    try:
        socket.create_connection((host, port), timeout=3).close()
        print(f"database {host}:{port} is accepting connections", flush=True)
        sys.exit(0)
    except OSError as exc:
        if time.monotonic() > deadline:
            sys.exit(f"gave up waiting for database {host}:{port}: {exc}")
        print(f"waiting for database {host}:{port}: {exc}", flush=True)
        time.sleep(2)
{{- end }}
