"""The Lua filter that routes requests from clients that send no x-model-name header.

Stock KServe clients (tritonclient) put the model name only in the request body. For unary
calls Envoy buffers the body, this script reads field 1 (model_name) and field 2
(model_version) of the protobuf message and sets them as headers, then clears the route cache
so the route is chosen again by model. Streams are not buffered: they need the header.
The script matches by path only, not by content type: gRPC-Web calls (binary
``application/grpc-web[+proto]``, the same 5-byte framing; text mode is decoded first) reach it
as gRPC, since Envoy's grpc_web filter runs before it (``control_plane.xds.edge``).
"""

from __future__ import annotations

from collections.abc import Iterable

from control_plane.model.mesh import Affinity
from control_plane.xds import affinity
from control_plane.xds.lua_template import fill, lua_strings
from infermesh.wire import MODEL_HEADER, VERSION_HEADER

LUA_FILTER = "envoy.filters.http.lua"

# Unary KServe requests whose field 1 is the model name.
BODY_ROUTED_METHODS = (
    "ModelInfer",
    "ModelReady",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
)

# Copies model_name (field 1) and model_version (field 2) of a unary KServe request into
# headers so that the route can be chosen by model. Only the body's first bytes are copied into
# Lua; anything it cannot read leaves the request untouched. (bodyChunks() cannot be used: the
# Lua filter lets the headers go on while it waits for chunks, so they can no longer be changed.)
LUA_BODY_ROUTER = r"""
local PATHS = {}
for _, m in ipairs({METHODS}) do PATHS["/inference.GRPCInferenceService/" .. m] = true end
-- Bytes read from the body's start: field 1 comes first from every common serializer.
local PREFIXES = {1024, 65536}

-- Varint at 1-based pos of s: value and next pos, or nil when s ends first. Of a tenth byte
-- only the lowest bit counts (bit 63), as protobuf keeps the low 64 bits: a value padded with
-- higher bits reads as the parser behind it reads it.
local function varint(s, pos)
  local value, scale = 0, 1
  for i = pos, math.min(#s, pos + 9) do
    local b = string.byte(s, i)
    value = value + (i == pos + 9 and b % 2 or b % 128) * scale
    if b < 128 then return value, i + 1 end
    scale = scale * 128
  end
  return nil
end

-- Scans the gRPC message at the start of s: done (false: s ends too soon to tell), name, version.
local function model_fields(s)
  if #s < 5 then return false end
  local flag, b1, b2, b3, b4 = string.byte(s, 1, 5)
  if flag ~= 0 then return true end -- compressed: unreadable here
  local stop = 6 + ((b1 * 256 + b2) * 256 + b3) * 256 + b4
  local pos, name, version = 6, nil, nil
  while pos < stop do
    local key, len
    key, pos = varint(s, pos)
    if key == nil then return false, name, version end
    local field, wire = math.floor(key / 8), key % 8
    if wire == 0 then
      len, pos = varint(s, pos)
      if len == nil then return false, name, version end
    elseif wire == 1 then pos = pos + 8
    elseif wire == 5 then pos = pos + 4
    elseif wire == 2 then
      len, pos = varint(s, pos)
      if len == nil then return false, name, version end
      if pos + len > stop then return true end
      if field == 1 or field == 2 then
        if len > 512 then return true end -- no real model name: leave the request alone
        if pos + len > #s + 1 then return false, name, version end
        local value = string.sub(s, pos, pos + len - 1)
        if field == 1 then name = value else version = value end
      end
      pos = pos + len
    else return true end
    -- Serializers write fields in number order: past field 2 there is nothing to find.
    if name ~= nil and (version ~= nil or field > 2) then return true, name, version end
  end
  return true, name, version
end

local function header_safe(value)
  return value ~= nil and string.find(value, "^[!-~]+$") ~= nil
end

-- The model name and version of a unary call's body (nil when unreadable or unsafe).
local function body_model(body)
  if body == nil or body:length() < 5 then return nil end
  local size, ok, done, name, version = body:length(), false, false, nil, nil
  for _, n in ipairs(PREFIXES) do
    ok, done, name, version = pcall(model_fields, body:getBytes(0, math.min(n, size)))
    if not ok or done or n >= size then break end
  end
  if not ok or not header_safe(name) then return nil end
  return name, version
end

{ENTRY}"""


# Routing only: a header-less unary call gets the model's headers from its body.
ROUTING_ENTRY = r"""function envoy_on_request(handle)
  local headers = handle:headers()
  if headers:get("{MODEL_HEADER}") ~= nil or not PATHS[headers:get(":path")] then return end
  local body = handle:body()
  local name, version = body_model(body)
  if name == nil then return end
  headers = handle:headers() -- a wrapper taken before a yield is dead after it
  headers:replace("{MODEL_HEADER}", name)
  if header_safe(version) then headers:replace("{VERSION_HEADER}", version) end
  handle:clearRouteCache()
end
"""

# With affinity (control_plane.xds.affinity): every request the script runs on may get the
# x-infermesh-affinity header, a header-less one once its model is known from the body.
AFFINITY_ENTRY = r"""function envoy_on_request(handle)
  local headers = handle:headers()
  local path, model = headers:get(":path"), headers:get("{MODEL_HEADER}")
  if model ~= nil or not PATHS[path] then return set_affinity(handle, model, path, nil) end
  local body = handle:body()
  local name, version = body_model(body)
  if name == nil then return end
  headers = handle:headers()
  headers:replace("{MODEL_HEADER}", name)
  if header_safe(version) then headers:replace("{VERSION_HEADER}", version) end
  set_affinity(handle, name, path, body)
  handle:clearRouteCache()
end
"""

# The varint reader alone, which the token admission script shares (an addition here, so the
# scripts that extend the body router merge apart: control_plane.xds.token_admission).
LUA_VARINT = LUA_BODY_ROUTER[
    LUA_BODY_ROUTER.index("local function varint") : LUA_BODY_ROUTER.index("-- Scans the gRPC")
]


def lua_source(affinities: Iterable[tuple[str, Affinity]] = ()) -> str:
    """The body-routing Lua script with this module's header names and method list, and the
    affinity of ``affinities``' models (``control_plane.xds.affinity``) if any."""
    affinities = tuple(affinities)
    entry = fill(
        AFFINITY_ENTRY if affinities else ROUTING_ENTRY,
        MODEL_HEADER=MODEL_HEADER,
        VERSION_HEADER=VERSION_HEADER,
    )
    functions = affinity.lua_functions(affinities) if affinities else ""
    return fill(LUA_BODY_ROUTER, METHODS=lua_strings(BODY_ROUTED_METHODS), ENTRY=functions + entry)
