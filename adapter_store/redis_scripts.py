"""The Redis backend's Lua scripts: each runs atomically, so a reader sees all or nothing.

Key layout (``P`` is the store's prefix; names and tenants never contain ``:``):

    P:blob:<digest>              hash  manifest (JSON: sizes, chunk checksums), num_chunks
    P:blob:<digest>:<i>          chunk i of the blob
    P:blob:<digest>:refs         set   "<tenant>/<name>@<version>" of every version using it
    P:upload:<token>:<i>         chunk i of an upload in progress (expires)
    P:upload:<token>:committed   the version an upload became (expires; makes COMMIT retryable)
    P:tenant:<t>:names           set   the tenant's names with at least one version
    P:tenant:<t>:adapter:<name>  hash  version -> record (JSON)
    P:tenant:<t>:adapter:<name>:next    the last version number handed out (never reused)

and one Pub/Sub channel:

    P:stored                     each put's digest, published once its version is committed
"""

from __future__ import annotations

# KEYS: 1 manifest, 2 refs, 3 names, 4 versions, 5 next, 6 committed marker,
#       then n staging chunk keys, then n blob chunk keys.
# ARGV: 1 n, 2 manifest JSON, 3 name, 4 record JSON, 5 ref prefix "<tenant>/<name>@",
#       6 blob chunk key prefix "P:blob:<digest>:", 7 marker TTL (seconds).
# Returns the new version. Renaming over chunks already committed under this digest is
# deliberate: an upload does the same work whether or not the digest was stored before.
COMMIT = """
local done = redis.call('GET', KEYS[6])
if done then return tonumber(done) end
local n = tonumber(ARGV[1])
for i = 1, n do
  if redis.call('EXISTS', KEYS[6 + i]) == 0 then
    return redis.error_reply('LOST upload chunk ' .. (i - 1) ..
      ' is gone (it expired, or the server restarted without persistence)')
  end
end
local old = tonumber(redis.call('HGET', KEYS[1], 'num_chunks') or '0')
for i = 1, n do
  redis.call('RENAME', KEYS[6 + i], KEYS[6 + n + i])
  redis.call('PERSIST', KEYS[6 + n + i])
end
for i = n, old - 1 do
  redis.call('UNLINK', ARGV[6] .. i)
end
redis.call('HSET', KEYS[1], 'manifest', ARGV[2], 'num_chunks', n)
local version = redis.call('INCR', KEYS[5])
redis.call('HSET', KEYS[4], version, ARGV[4])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[5] .. version)
redis.call('SET', KEYS[6], version, 'EX', tonumber(ARGV[7]))
return version
"""

# KEYS: 1 versions, 2 names.
# ARGV: 1 name, 2 version ('' for all), 3 key prefix P, 4 ref prefix "<tenant>/<name>@".
# Returns {version, record, ...} of what was deleted; drops blobs no version refers to.
DELETE = """
local versions
if ARGV[2] == '' then
  versions = redis.call('HKEYS', KEYS[1])
elseif redis.call('HEXISTS', KEYS[1], ARGV[2]) == 1 then
  versions = {ARGV[2]}
else
  versions = {}
end
local out = {}
for _, v in ipairs(versions) do
  local record = redis.call('HGET', KEYS[1], v)
  redis.call('HDEL', KEYS[1], v)
  local ok, doc = pcall(cjson.decode, record)
  local digest = ok and type(doc) == 'table' and doc['digest']
  if type(digest) == 'string' and #digest == 64 and not string.find(digest, '[^0-9a-f]') then
    local blob = ARGV[3] .. ':blob:' .. digest
    redis.call('SREM', blob .. ':refs', ARGV[4] .. v)
    if redis.call('SCARD', blob .. ':refs') == 0 then
      local num = tonumber(redis.call('HGET', blob, 'num_chunks') or '0')
      for i = 0, num - 1 do
        redis.call('UNLINK', blob .. ':' .. i)
      end
      redis.call('UNLINK', blob)
    end
  end
  table.insert(out, v)
  table.insert(out, record)
end
if redis.call('HLEN', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[2], ARGV[1])
end
return out
"""
