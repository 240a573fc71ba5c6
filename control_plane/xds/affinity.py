"""Prefix and session affinity in Envoy, with bounded load: no per-request callout.

A model with ``affinity`` (``control_plane.model.mesh.Affinity``) gets, deterministically
from the topology (every control-plane replica makes the same configuration):

* its clusters on Envoy's **Maglev** load balancer, which honours the endpoints' EDS weights
  (the telemetry weights: ejection, drain and slow start act through them), with
  ``hash_balance_factor``: consistent hashing with bounded loads (Mirrokni et al.), so no
  endpoint takes more than factor/100 x the mean of requests in flight and a hot key spills
  to the next endpoints of the table instead of melting one server;
* a route ``hash_policy`` on the ``x-infermesh-affinity`` header, which the edge's Lua filter
  sets (clients cannot: every ``x-infermesh-*`` header they send is removed first). Without
  the header Maglev picks a random endpoint, still under the same bound;
* the Lua below, on the model's routes: ``p`` + hex of the prompt's first KV blocks for
  ``prefix`` (gRPC ModelInfer ``text_input``, raw or ``bytes_contents``; KServe REST JSON;
  OpenAI ``prompt`` / ``messages``), ``s`` + hex of the tenant and the session header (or
  OpenAI ``user``) for ``session`` and for prefix requests with no prompt to read.
"""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from google.protobuf.wrappers_pb2 import UInt32Value

from control_plane.model.mesh import Affinity
from control_plane.xds.lua_template import fill, lua_string
from control_plane.xds.namespaces import AUTH_NAMESPACE
from infermesh.wire import AFFINITY_HEADER

PROMPT_INPUT = "text_input"  # the generative models' prompt tensor (BYTES)
GRPC_READ_BYTES = 65536  # a prompt's first blocks are within the message's first 64 KiB
JSON_MAX_BYTES = 262144  # a JSON body larger than this is not parsed: no prefix key


def balance(cluster: cluster_pb2.Cluster, affinity: Affinity) -> cluster_pb2.Cluster:
    """Maglev with bounded load on ``cluster`` (weights honoured; no slow_start_config:
    that is a round-robin / least-request option, and the control plane's slow start is in
    the weights instead)."""
    cluster.lb_policy = cluster_pb2.Cluster.MAGLEV
    bounded = cluster.common_lb_config.consistent_hashing_lb_config
    bounded.hash_balance_factor.CopyFrom(UInt32Value(value=affinity.hash_balance_factor))
    return cluster


def hash_policy(action: rc_pb2.RouteAction) -> rc_pb2.RouteAction:
    action.hash_policy.add().header.header_name = AFFINITY_HEADER
    return action


def lua_table(affinities: Iterable[tuple[str, Affinity]]) -> str:
    """The models' affinity settings as a Lua table constructor."""
    rows = [
        f"[{lua_string(name)}] = {{session = {str(a.mode == 'session').lower()}, "
        f"bytes = {a.prefix_bytes}, block = {a.block_bytes}, "
        f"header = {lua_string(a.session_header)}, "
        f"streams = {str(a.one_request_streams).lower()}}}"
        for name, a in sorted(affinities)
    ]
    return "{" + ", ".join(rows) + "}"


# Defines affinity_key(handle, model, path, body); uses varint() of the body-routing script.
LUA_AFFINITY = r"""
local AFFINITY = {TABLE}
local AFFINITY_HEADER = "{HEADER}"
local INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
local STREAM_PATH = "/inference.GRPCInferenceService/ModelStreamInfer"
local OPENAI = {["/v1/completions"] = true, ["/v1/chat/completions"] = true}

local function hex(s)
  return (string.gsub(s, ".", function(c) return string.format("%02x", string.byte(c)) end))
end

-- Calls fn(field, start, len) for each length-delimited field of the message in s[pos, stop);
-- stops when fn returns true or the bytes end.
local function each(s, pos, stop, fn)
  stop = math.min(stop, #s + 1)
  while pos < stop do
    local key, len
    key, pos = varint(s, pos)
    if key == nil then return end
    local field, wire = math.floor(key / 8), key % 8
    if wire == 0 then
      len, pos = varint(s, pos)
      if len == nil then return end
    elseif wire == 1 then pos = pos + 8
    elseif wire == 5 then pos = pos + 4
    elseif wire == 2 then
      len, pos = varint(s, pos)
      if len == nil or fn(field, pos, len) then return end
      pos = pos + len
    else return end
  end
end

-- The first element of the ModelInferRequest's text_input tensor: inputs (5) name (1), its
-- contents (5) bytes_contents (8), or the matching raw_input_contents (7) after its 4-byte
-- little-endian length.
local function grpc_prompt(s, limit)
  if #s < 5 or string.byte(s, 1) ~= 0 then return nil end
  local b1, b2, b3, b4 = string.byte(s, 2, 5)
  local stop = 6 + ((b1 * 256 + b2) * 256 + b3) * 256 + b4
  local index, wanted, raw, prompt = 0, nil, 0, nil
  each(s, 6, stop, function(field, start, len)
    if field == 5 then
      local name, content
      each(s, start, start + len, function(f, a, l)
        if f == 1 then name = string.sub(s, a, a + l - 1)
        elseif f == 5 then
          each(s, a, a + l, function(g, x, m)
            if g == 8 then content = string.sub(s, x, x + math.min(m, limit) - 1) return true end
          end)
        end
      end)
      if name == "{INPUT}" and wanted == nil then wanted, prompt = index, content end
      index = index + 1
    elseif field == 7 then
      if raw == wanted and prompt == nil then
        local x1, x2, x3, x4 = string.byte(s, start, start + 3)
        if x4 == nil or len < 4 then return true end
        local n = math.min(x1 + x2 * 256 + x3 * 65536 + x4 * 16777216, len - 4, limit)
        prompt = string.sub(s, start + 4, start + 3 + n)
        return true
      end
      raw = raw + 1
    end
  end)
  return prompt
end

-- A small JSON reader (a value at i: the value and the next position; errors on bad input).
local ESCAPES = {['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n",
                 r = "\r", t = "\t"}
local function skip(s, i) return string.find(s, "[^ \t\r\n]", i) or #s + 1 end
local function utf8(code)
  if code < 128 then return string.char(code) end
  if code < 2048 then return string.char(192 + math.floor(code / 64), 128 + code % 64) end
  return string.char(224 + math.floor(code / 4096), 128 + math.floor(code / 64) % 64,
                     128 + code % 64)
end
local function json_string(s, i)
  local out, j = {}, i + 1
  while true do
    local a = string.find(s, '["\\]', j)
    if a == nil then error("unterminated string") end
    out[#out + 1] = string.sub(s, j, a - 1)
    if string.sub(s, a, a) == '"' then return table.concat(out), a + 1 end
    local c = string.sub(s, a + 1, a + 1)
    if c == "u" then
      local code = tonumber(string.sub(s, a + 2, a + 5), 16)
      if code == nil then error("bad escape") end
      out[#out + 1], j = utf8(code), a + 6
    elseif ESCAPES[c] then out[#out + 1], j = ESCAPES[c], a + 2
    else error("bad escape") end
  end
end
local json_value
local function json_list(s, i, close, item)
  i = skip(s, i + 1)
  if string.sub(s, i, i) == close then return i + 1 end
  while true do
    i = skip(s, item(s, i))
    local c = string.sub(s, i, i)
    if c == close then return i + 1 end
    if c ~= "," then error("expected ,") end
    i = skip(s, i + 1)
  end
end
function json_value(s, i, depth)
  if depth > 32 then error("too deep") end
  i = skip(s, i)
  local c = string.sub(s, i, i)
  if c == '"' then return json_string(s, i) end
  if c == "{" then
    local object = {}
    return object, json_list(s, i, "}", function(_, at)
      if string.sub(s, at, at) ~= '"' then error("expected a key") end
      local key, next_at = json_string(s, at)
      next_at = skip(s, next_at)
      if string.sub(s, next_at, next_at) ~= ":" then error("expected :") end
      object[key], next_at = json_value(s, next_at + 1, depth + 1)
      return next_at
    end)
  end
  if c == "[" then
    local array = {}
    return array, json_list(s, i, "]", function(_, at)
      local value, next_at = json_value(s, at, depth + 1)
      array[#array + 1] = value == nil and false or value
      return next_at
    end)
  end
  local a, b = string.find(s, "^[-+.%w]+", i)
  if a == nil then error("expected a value") end
  local word = string.sub(s, a, b)
  if word == "true" then return true, b + 1 elseif word == "false" then return false, b + 1
  elseif word == "null" then return nil, b + 1 end
  return tonumber(word) or error("bad number"), b + 1
end

local function first_string(value, depth)
  if type(value) == "string" then return value end
  if type(value) == "table" and depth < 4 then return first_string(value[1], depth + 1) end
  return nil
end

-- role, newline, text, newline of each message in order, until limit bytes
local function chat_text(messages, limit)
  local parts, size = {}, 0
  for _, m in ipairs(messages) do
    if type(m) ~= "table" then break end
    local content = m.content
    if type(content) == "table" then
      local texts = {}
      for _, part in ipairs(content) do
        if type(part) == "table" and type(part.text) == "string" then
          texts[#texts + 1] = part.text
        end
      end
      content = table.concat(texts)
    end
    if type(content) ~= "string" then break end
    parts[#parts + 1] = tostring(m.role) .. "\n" .. content .. "\n"
    size = size + #parts[#parts]
    if size >= limit then break end
  end
  return table.concat(parts)
end

-- (prompt, model, user) of a JSON body: KServe REST inputs, OpenAI prompt or messages
local function json_prompt(s, path, limit)
  local doc = json_value(s, 1, 0)
  if type(doc) ~= "table" then return nil end
  local prompt
  if path == "/v1/completions" then prompt = first_string(doc.prompt, 0)
  elseif path == "/v1/chat/completions" then
    if type(doc.messages) == "table" then prompt = chat_text(doc.messages, limit) end
  elseif type(doc.inputs) == "table" then
    for _, input in ipairs(doc.inputs) do
      if type(input) == "table" and input.name == "{INPUT}" then
        prompt = first_string(input.data, 0)
        break
      end
    end
  end
  local model = type(doc.model) == "string" and doc.model or nil
  return prompt, model, type(doc.user) == "string" and doc.user or nil
end

local function rest_model(path)
  return string.match(path, "^/v2/models/([^/?]+)/")
end

local function tenant(handle)
  local ok, auth = pcall(function()
    return handle:streamInfo():dynamicMetadata():get("{AUTH}")
  end)
  if ok and type(auth) == "table" and type(auth.tenant) == "string" then return auth.tenant end
  return ""
end

-- Sets x-infermesh-affinity for a request of an affinity model; body: the body, if read.
local function set_affinity(handle, model, path, body)
  path = string.match(path or "", "^[^?]*")
  local grpc = path == INFER_PATH or path == STREAM_PATH
  local json = OPENAI[path] or string.find(path, "^/v2/models/[^?]*/infer$") ~= nil
  model = model or rest_model(path)
  local a = model and AFFINITY[model]
  if a == nil and not OPENAI[path] then return end
  local prompt, user
  local readable = json or path == INFER_PATH or (path == STREAM_PATH and a ~= nil and a.streams)
  if readable and (a == nil or not a.session or OPENAI[path]) then
    body = body or handle:body()
    local size = body and body:length() or 0
    if size > 0 and (grpc or size <= {JSON_MAX}) then
      local limit = a and a.bytes or 4096
      local ok, found, named, who
      if grpc then
        ok, found = pcall(grpc_prompt, body:getBytes(0, math.min(size, {GRPC_READ})), limit)
      else ok, found, named, who = pcall(json_prompt, body:getBytes(0, size), path, limit) end
      if ok then prompt, user, model = found, who, model or named end
    end
  end
  a = model and AFFINITY[model]
  if a == nil then return end
  local key
  if not a.session and type(prompt) == "string" then
    local n = math.min(#prompt, a.bytes)
    n = n - n % a.block
    if n >= a.block then key = "p" .. hex(string.sub(prompt, 1, n)) end
  end
  if key == nil then
    local session = handle:headers():get(a.header) or user
    if session ~= nil then
      key = "s" .. hex(tenant(handle)) .. "." .. hex(string.sub(session, 1, 256))
    end
  end
  if key ~= nil then handle:headers():replace(AFFINITY_HEADER, key) end
end
"""


def lua_functions(affinities: Iterable[tuple[str, Affinity]]) -> str:
    """The Lua that defines ``set_affinity`` for these models."""
    return fill(
        LUA_AFFINITY,
        TABLE=lua_table(affinities),
        HEADER=AFFINITY_HEADER,
        INPUT=PROMPT_INPUT,
        AUTH=AUTH_NAMESPACE,
        JSON_MAX=str(JSON_MAX_BYTES),
        GRPC_READ=str(GRPC_READ_BYTES),
    )
