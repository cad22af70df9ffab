{{/* Redis configuration (the ConfigMap and the pod checksum). */}}
{{- define "loraplex.redis.conf" -}}
# The adapter store: durable (AOF, fsync every second, plus RDB snapshots for backups)
# and never evicting (an evicted chunk would be a lost adapter).
bind * -::*
port {{ .Values.redis.port }}
dir /data
appendonly yes
appendfsync {{ .Values.redis.appendfsync }}
aof-use-rdb-preamble yes
save 3600 1 300 100 60 10000
maxmemory-policy noeviction
protected-mode yes
# The password, written from its Secret at start (never in a manifest or on a command line).
include /run/redis/auth.conf
{{- end -}}
