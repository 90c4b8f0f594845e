-- Wireshark dissector for netdam, protocol version 1 (docs/PROTOCOL.md).
--
-- Load it with `tshark -X lua_script:tools/wireshark/netdam.lua ...`, or copy
-- it into ~/.local/lib/wireshark/plugins/ (docs/WIRESHARK.md).
--
-- Layout of a datagram (PROTOCOL.md section 3):
--   header (40 B) | [preamble (16 B) | segments (24 B each)] | payload | CRC32C (4 B)
-- Protocol structures are big-endian, element data little-endian (section 2).
--
-- The numeric tables below mirror include/netdam/types.h, core/aggregation.h,
-- include/netdam/optimizer.h and pool/pool_wire.h; a new opcode or status
-- there needs a line here.
--
-- Answers do not say what a chain's last segment was, nor is that needed by a
-- client; a reader of a capture wants to know, so requests are remembered by
-- txn on the first pass and their answers decoded with what the request said.

local netdam = Proto("netdam", "netdam (NetDAM over UDP)")

local HEADER = 40
local PREAMBLE = 16
local SEGMENT = 24
local TRAILER = 4
local MAGIC = 0x4E44414D

-- Lua 5.2 (Wireshark up to 4.2) has bit32; later Wireshark runs Lua 5.4,
-- which has native operators but no bit32. The operators would not even
-- parse under 5.2, hence load().
local band, bxor, rshift
if bit32 then
  band, bxor, rshift = bit32.band, bit32.bxor, bit32.rshift
else
  band = load("return function(a, b) return a & b end")()
  bxor = load("return function(a, b) return a ~ b end")()
  rshift = load("return function(a, n) return a >> n end")()
end

---------------------------------------------------------------- vocabulary --

local OP = {
  PING = 0x01, STATS = 0x02, READ = 0x10, WRITE = 0x11, FILL = 0x12, COPY = 0x13,
  ARM = 0x14, FETCH_ADD = 0x20, COMPARE_SWAP = 0x21, SWAP = 0x22,
  REDUCE_MEM = 0x30, REDUCE_PAYLOAD = 0x31, OPT_CONFIG = 0x33, OPT_STEP = 0x34,
  AGGREGATE = 0x35, CHAIN = 0x40, REGION_ADD = 0x50, REGION_DEL = 0x51,
  REGION_LIST = 0x52, POOL_ALLOC = 0x60, POOL_FREE = 0x61, POOL_LOOKUP = 0x62,
  POOL_LIST = 0x63, POOL_MAP = 0x64, POOL_STAT = 0x65,
}
local opcode_names = {}
for name, v in pairs(OP) do opcode_names[v] = name end

local status_names = {
  [0] = "OK", "BAD_VERSION", "BAD_OPCODE", "BAD_TYPE", "BAD_REDOP", "BAD_LENGTH",
  "BAD_KEY", "OUT_OF_BOUNDS", "MISALIGNED", "BAD_SEGMENT", "NOT_PERMITTED",
  "BOOT_MISMATCH", "STALE_TXN", "NO_SPACE", "BAD_PAYLOAD", "BAD_FLAGS", "NOT_READY",
  "STALE_GENERATION", "NO_SUCH_ALLOCATION", "DEVICE_LOST", "UNAVAILABLE",
  "ALREADY_EXISTS", "NO_OPTIMIZER", "TXN_AHEAD", "NOT_VALIDATED",
}
local dtype_names = { [0] = "bytes", "f32", "f16", "bf16", "f64", "i32", "i64" }
local dtype_size = { [0] = 1, 4, 2, 2, 8, 4, 8 }
local redop_names = { [0] = "none", "sum", "min", "max" }
local opt_kind_names = { [1] = "SGD", "Adam", "AdamW" }
local policy_names = { [0] = "interleaved", "single", "replicated" }
local alloc_state_names = { [0] = "ok", "degraded", "lost", "unavailable" }
local device_state_names = { [0] = "up", "down", "unknown" }
local crc_status_names = { [0] = "Bad", "Good" }

-------------------------------------------------------------------- fields --

local f = {}
local function field(key, ctor, abbr, ...)
  f[key] = ctor("netdam." .. abbr, ...)
end
local U8, U16, U32, U64 = ProtoField.uint8, ProtoField.uint16, ProtoField.uint32, ProtoField.uint64
local HEX, DEC = base.HEX, base.DEC

-- header (3.1, 3.2)
field("magic", U32, "magic", "Magic", HEX)
field("version", U8, "version", "Version", DEC)
field("opcode", U8, "opcode", "Opcode", HEX, opcode_names)
field("flags", U8, "flags", "Flags", HEX)
field("fl_response", ProtoField.bool, "flags.response", "RESPONSE", 8, nil, 0x01)
field("fl_ack_req", ProtoField.bool, "flags.ack_req", "ACK_REQ", 8, nil, 0x02)
field("fl_sparse", ProtoField.bool, "flags.sparse", "SPARSE", 8, nil, 0x04)
field("fl_sparse_ok", ProtoField.bool, "flags.sparse_ok", "SPARSE_OK", 8, nil, 0x08)
field("fl_direct", ProtoField.bool, "flags.direct", "DIRECT (pool proxy: devices answer)", 8, nil, 0x10)
field("fl_gather", ProtoField.bool, "flags.gather", "GATHER (pool proxy: gathered parts)", 8, nil, 0x20)
field("fl_reserved", U8, "flags.reserved", "Reserved bits", HEX, nil, 0xC0)
field("status", U8, "status", "Status", DEC, status_names)
field("dtype", U8, "dtype", "Element type", DEC, dtype_names)
field("redop", U8, "redop", "Reduction", DEC, redop_names)
field("seg_count", U8, "seg_count", "Segment count", DEC)
field("depth", U8, "depth", "Queue depth (of 255)", DEC)
field("seg_index", U8, "seg_index", "Segment index", DEC)
field("rkey", U32, "rkey", "Region key", HEX)
field("txn", U64, "txn", "Transaction id", DEC)
field("addr", U64, "addr", "Address", HEX)
field("length", U32, "length", "Length", DEC)
field("boot", U32, "boot", "Boot id / cookie", HEX)
field("is_response", ProtoField.bool, "response", "Is an answer")
field("request_in", ProtoField.framenum, "request_in", "Request in frame", base.NONE,
      frametype and frametype.REQUEST)
field("response_in", ProtoField.framenum, "response_in", "Answer in frame", base.NONE,
      frametype and frametype.RESPONSE)

-- segment routing (3.3, 3.4)
field("sr_reply_ip", ProtoField.ipv4, "sr.reply_ip", "Reply-to IP")
field("sr_reply_port", U16, "sr.reply_port", "Reply-to port", DEC)
field("sr_flags", U16, "sr.flags", "Preamble flags (reserved)", HEX)
field("sr_generation", U32, "sr.generation", "Generation", DEC)
field("sr_reserved", U32, "sr.reserved", "Reserved", HEX)
field("seg", ProtoField.none, "seg", "Segment")
field("seg_ip", ProtoField.ipv4, "seg.ip", "IP")
field("seg_port", U16, "seg.port", "Port", DEC)
field("seg_opcode", U8, "seg.opcode", "Opcode", HEX, opcode_names)
field("seg_flags", U8, "seg.flags", "Segment flags", HEX)
field("sf_gen", ProtoField.bool, "seg.flags.gen", "GEN", 8, nil, 0x01)
field("sf_skip_stale", ProtoField.bool, "seg.flags.skip_stale", "SKIP_STALE", 8, nil, 0x02)
field("sf_stamp", ProtoField.bool, "seg.flags.stamp", "STAMP", 8, nil, 0x04)
field("sf_await", ProtoField.bool, "seg.flags.await", "AWAIT", 8, nil, 0x08)
field("sf_reserved", U8, "seg.flags.reserved", "Reserved bits", HEX, nil, 0xF0)
field("seg_rkey", U32, "seg.rkey", "Region key", HEX)
field("seg_aux", U32, "seg.aux", "Aux (stamp offset / block)", HEX)
field("seg_addr", U64, "seg.addr", "Address", HEX)

-- payloads
field("payload", ProtoField.bytes, "payload", "Payload")
field("payload_len", U32, "payload.len", "Payload length", DEC)
field("data", ProtoField.bytes, "data", "Data")
field("elements", U32, "elements", "Elements", DEC)
field("e_f32", ProtoField.float, "elem.f32", "f32")
field("e_f16", ProtoField.float, "elem.f16", "f16")
field("e_bf16", ProtoField.float, "elem.bf16", "bf16")
field("e_f64", ProtoField.double, "elem.f64", "f64")
field("e_i32", ProtoField.int32, "elem.i32", "i32", DEC)
field("e_i64", ProtoField.int64, "elem.i64", "i64", DEC)
field("e_byte", U8, "elem.byte", "byte", HEX)
field("sparse_pairs", U32, "sparse.pairs", "Sparse pairs", DEC)
field("sparse_index", U32, "sparse.index", "Index", DEC)

-- PING (6.1)
field("ping_boot_id", U32, "ping.boot_id", "Boot id", HEX)
field("ping_max_payload", U32, "ping.max_payload", "Max payload", DEC)
field("ping_memory", U64, "ping.memory_bytes", "Memory bytes", DEC)
field("ping_regions", U32, "ping.regions", "Regions", DEC)
field("ping_window", U32, "ping.replay_window", "Replay window", DEC)
field("ping_version", U8, "ping.version", "Protocol version", DEC)
field("ping_flags", U8, "ping.flags", "Flags", HEX)
field("ping_pool_proxy", ProtoField.bool, "ping.flags.pool_proxy", "POOL_PROXY (64-bit keys)", 8, nil, 0x01)
field("ping_reserved", ProtoField.bytes, "ping.reserved", "Reserved")
field("ping_cookie", U32, "ping.cookie", "Address cookie", HEX)
-- STATS (6.2)
field("stats_entries", U32, "stats.entries", "Entries", DEC)
field("stats_entry", ProtoField.none, "stats.entry", "Entry")
field("stats_name", ProtoField.string, "stats.name", "Name")
field("stats_value", U64, "stats.value", "Value", DEC)
-- FILL, COPY, ARM (6.5 - 6.7)
field("fill_pattern", ProtoField.bytes, "fill.pattern", "Pattern")
field("copy_src_addr", U64, "copy.src_addr", "Source address", HEX)
field("copy_src_key", U32, "copy.src_key", "Source key", HEX)
field("copy_reserved", U32, "copy.reserved", "Reserved", HEX)
field("arm_generation", U32, "arm.generation", "New generation", DEC)
field("arm_previous", U32, "arm.previous", "Previous generation", DEC)
-- atomics (6.8), little-endian operands
field("at_addend", U64, "atomic.addend", "Addend", DEC)
field("at_new", U64, "atomic.new", "New value", DEC)
field("at_expected", U64, "atomic.expected", "Expected", DEC)
field("at_desired", U64, "atomic.desired", "Desired", DEC)
field("at_old", U64, "atomic.old", "Previous value", DEC)
-- OPT_CONFIG (6.11)
field("opt_kind", U8, "opt.kind", "Kind", DEC, opt_kind_names)
field("opt_flags", U8, "opt.flags", "Flags", HEX)
field("opt_nesterov", ProtoField.bool, "opt.flags.nesterov", "Nesterov", 8, nil, 0x01)
field("opt_reserved", ProtoField.bytes, "opt.reserved", "Reserved")
field("opt_step", U64, "opt.step", "Step", DEC)
field("opt_lr", ProtoField.double, "opt.lr", "Learning rate")
field("opt_wd", ProtoField.double, "opt.weight_decay", "Weight decay")
field("opt_m1", ProtoField.double, "opt.momentum_beta1", "Momentum / beta1")
field("opt_m2", ProtoField.double, "opt.dampening_beta2", "Dampening / beta2")
field("opt_eps", ProtoField.double, "opt.eps", "Epsilon")
field("opt_scale", ProtoField.double, "opt.grad_scale", "Gradient scale")
field("opt_state1", U64, "opt.state1", "State 1 offset", HEX)
field("opt_state2", U64, "opt.state2", "State 2 offset", HEX)
-- AGGREGATE (6.13)
field("agg_contributor", U16, "agg.contributor", "Contributor", DEC)
field("agg_contributors", U16, "agg.contributors", "Contributors", DEC)
field("agg_stride", U32, "agg.stride", "Stride", DEC)
field("agg_flags", U32, "agg.flags", "Flags", HEX)
field("agg_zero", ProtoField.bool, "agg.flags.zero", "ZERO", 32, nil, 0x1)
field("agg_no_result", ProtoField.bool, "agg.flags.no_result", "NO_RESULT", 32, nil, 0x2)
field("agg_skip", ProtoField.bool, "agg.flags.skip", "SKIP", 32, nil, 0x4)
field("agg_staged", ProtoField.bool, "agg.flags.staged", "STAGED", 32, nil, 0x8)
field("agg_optimize", ProtoField.bool, "agg.flags.optimize", "OPTIMIZE", 32, nil, 0x10)
field("agg_quiet", ProtoField.bool, "agg.flags.quiet", "QUIET (no held answer)", 32, nil, 0x20)
field("agg_weights", U32, "agg.weights", "Weights region key (OPTIMIZE)", HEX)
field("agg_generation", U32, "agg.generation", "Generation", DEC)
field("agg_answer_flags", U32, "agg.answer_flags", "Answer flags", HEX)
field("agg_result_zero", ProtoField.bool, "agg.answer_flags.result_zero", "RESULT_ZERO", 32, nil, 0x1)
field("agg_none", ProtoField.bool, "agg.answer_flags.none", "NONE", 32, nil, 0x2)
field("agg_held", ProtoField.bool, "agg.answer_flags.held", "HELD", 32, nil, 0x4)
field("agg_group", ProtoField.bool, "agg.answer_flags.group", "GROUP", 32, nil, 0x8)
field("agg_held_set", U64, "agg.held_set", "Contributors held", HEX)
-- regions (6.15)
field("region", ProtoField.none, "region", "Region")
field("region_count", U32, "region.count", "Records", DEC)
field("region_base", U64, "region.base", "Base", HEX)
field("region_size", U64, "region.size", "Size", DEC)
field("region_key", U32, "region.key", "Key", HEX)
field("region_perms", U32, "region.perms", "Permissions", HEX)
field("rp_read", ProtoField.bool, "region.perms.read", "read", 32, nil, 0x1)
field("rp_write", ProtoField.bool, "region.perms.write", "write", 32, nil, 0x2)
field("rp_plain", ProtoField.bool, "region.perms.plain_only", "plain requests only", 32, nil, 0x4)
-- pool (17.3)
field("pool_name_len", U8, "pool.name_len", "Name length", DEC)
field("pool_name", ProtoField.string, "pool.name", "Name")
field("pool_size", U64, "pool.size", "Size", DEC)
field("pool_stripe", U32, "pool.stripe", "Stripe", DEC)
field("pool_policy", U8, "pool.policy", "Policy", DEC, policy_names)
field("pool_devices", U8, "pool.devices", "Devices", DEC)
field("pool_first_device", U16, "pool.first_device", "First device", DEC)
field("pool_record", ProtoField.none, "pool.record", "Allocation")
field("pool_records", U32, "pool.records", "Records", DEC)
field("pool_base", U64, "pool.base", "Base", HEX)
field("pool_key", U64, "pool.key", "Key", HEX)
field("pool_copies", U8, "pool.copies", "Copies", DEC)
field("pool_state", U8, "pool.state", "State", DEC, alloc_state_names)
field("pool_reserved", ProtoField.bytes, "pool.reserved", "Reserved")
field("pool_slots", U8, "pool.slots", "Slots", DEC)
field("pool_slot", ProtoField.none, "pool.slot", "Slot")
field("slot_ip", ProtoField.ipv4, "pool.slot.ip", "IP")
field("slot_port", U16, "pool.slot.port", "Port", DEC)
field("slot_flags", U8, "pool.slot.flags", "Flags", HEX)
field("slot_live", ProtoField.bool, "pool.slot.flags.live", "LIVE", 8, nil, 0x01)
field("slot_lost", ProtoField.bool, "pool.slot.flags.lost", "LOST", 8, nil, 0x02)
field("slot_boot", U32, "pool.slot.boot", "Boot id", HEX)
field("slot_rkey", U32, "pool.slot.rkey", "Device key", HEX)
field("slot_base", U64, "pool.slot.base", "Device address", HEX)
field("pool_capacity", U64, "pool.capacity", "Capacity", DEC)
field("pool_used", U64, "pool.used", "Used", DEC)
field("pool_allocations", U32, "pool.allocations", "Allocations", DEC)
field("pool_device_count", U32, "pool.device_count", "Devices", DEC)
field("pool_device", ProtoField.none, "pool.device", "Device")
field("dev_ip", ProtoField.ipv4, "pool.device.ip", "IP")
field("dev_port", U16, "pool.device.port", "Port", DEC)
field("dev_state", U8, "pool.device.state", "State", DEC, device_state_names)
field("dev_boot", U32, "pool.device.boot", "Boot id", HEX)
field("dev_capacity", U64, "pool.device.capacity", "Capacity", DEC)
field("dev_used", U64, "pool.device.used", "Used", DEC)
field("dev_largest_free", U64, "pool.device.largest_free", "Largest free extent", DEC)
-- integrity trailer (3.5)
field("crc", U32, "crc", "CRC32C", HEX)
field("crc_computed", U32, "crc.computed", "CRC32C computed", HEX)
field("crc_status", U8, "crc.status", "CRC32C status", DEC, crc_status_names)

local fields = {}
for _, v in pairs(f) do fields[#fields + 1] = v end
netdam.fields = fields

local ef = {
  crc_bad = ProtoExpert.new("netdam.crc.bad", "CRC32C trailer does not match: receivers drop this datagram",
                            expert.group.CHECKSUM, expert.severity.ERROR),
  nak = ProtoExpert.new("netdam.nak", "NAK", expert.group.RESPONSE_CODE, expert.severity.NOTE),
  malformed = ProtoExpert.new("netdam.malformed", "Malformed netdam datagram",
                              expert.group.MALFORMED, expert.severity.ERROR),
  unexpected = ProtoExpert.new("netdam.unexpected_payload", "Payload not expected here",
                               expert.group.PROTOCOL, expert.severity.WARN),
}
netdam.experts = { ef.crc_bad, ef.nak, ef.malformed, ef.unexpected }

netdam.prefs.ports = Pref.range("UDP ports", "7000,7100",
                                "Ports decoded as netdam: netdamd's 7000 and netdam-mmu's 7100. " ..
                                "Other ports are found by the heuristic on the magic.", 65535)
netdam.prefs.max_items = Pref.uint("Elements shown", 16,
                                   "Largest number of elements or sparse pairs " ..
                                   "listed one by one; longer lists show their first ones")

-------------------------------------------------------------------- CRC32C --

-- Reflected Castagnoli polynomial (PROTOCOL.md 3.5).
local crc_table = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if band(c, 1) ~= 0 then c = bxor(rshift(c, 1), 0x82F63B78) else c = rshift(c, 1) end
  end
  crc_table[i] = c
end

local function crc32c(s)
  local c = 0xFFFFFFFF
  local byte = string.byte
  -- string.byte with a range returns many values at once, far fewer calls
  -- than one per byte on 64 KiB datagrams.
  for i = 1, #s, 256 do
    local chunk = { byte(s, i, math.min(i + 255, #s)) }
    for j = 1, #chunk do
      c = bxor(crc_table[band(bxor(c, chunk[j]), 0xFF)], rshift(c, 8))
    end
  end
  c = bxor(c, 0xFFFFFFFF)
  if c < 0 then c = c + 4294967296 end  -- Lua 5.4 without bit32: keep it unsigned
  return c
end

------------------------------------------------------------------- helpers --

local function max_items() return netdam.prefs.max_items end

local function f16_value(u)
  local sign = band(u, 0x8000) ~= 0 and -1 or 1
  local e = band(rshift(u, 10), 0x1F)
  local m = band(u, 0x3FF)
  if e == 0 then return sign * m * 2 ^ -24 end
  if e == 31 then return m == 0 and sign * math.huge or 0 / 0 end
  return sign * (1 + m / 1024) * 2 ^ (e - 15)
end

local function bf16_value(u)
  local sign = band(u, 0x8000) ~= 0 and -1 or 1
  local e = band(rshift(u, 7), 0xFF)
  local m = band(u, 0x7F)
  if e == 0 then return sign * m * 2 ^ -133 end
  if e == 255 then return m == 0 and sign * math.huge or 0 / 0 end
  return sign * (1 + m / 128) * 2 ^ (e - 127)
end

-- One little-endian element of `dtype` at range r.
local function add_element(tree, dtype, r, label)
  local item
  if dtype == 1 then item = tree:add_le(f.e_f32, r)
  elseif dtype == 2 then item = tree:add(f.e_f16, r, f16_value(r:le_uint()))
  elseif dtype == 3 then item = tree:add(f.e_bf16, r, bf16_value(r:le_uint()))
  elseif dtype == 4 then item = tree:add_le(f.e_f64, r)
  elseif dtype == 5 then item = tree:add_le(f.e_i32, r)
  elseif dtype == 6 then item = tree:add_le(f.e_i64, r)
  else item = tree:add(f.e_byte, r) end
  if label then item:prepend_text(label .. " ") end
  return item
end

-- "Data (N bytes): 0102..." with at most 32 bytes in hex: a tree item may
-- stand for 64 KiB.
local function data_text(tvb, off, len, name)
  local shown = math.min(len, 32)
  local hex = string.lower(tostring(tvb(off, shown):bytes()))
  return string.format("%s (%d bytes): %s%s", name or "Data", len, hex, len > shown and "..." or "")
end

-- Dense elements: their count, the bytes, and the first few decoded.
local function dense_elements(tvb, tree, off, len, dtype, name)
  local es = dtype_size[dtype]
  local t = tree:add(f.data, tvb(off, len))
  t:set_text(data_text(tvb, off, len, name))
  if not es or es == 1 and dtype == 0 then return t end
  local n = math.floor(len / es)
  t:add(f.elements, n):set_generated()
  for i = 0, math.min(n, max_items()) - 1 do
    add_element(t, dtype, tvb(off + i * es, es), "[" .. i .. "]")
  end
  if n > max_items() then t:add(string.format("... %d more elements", n - max_items())) end
  if len % es ~= 0 then t:add_proto_expert_info(ef.malformed, "length not a multiple of the element size") end
  return t
end

-- Sparse pairs (section 11): index u32 BE, value of the element size LE.
local function sparse_elements(tvb, tree, off, len, dtype)
  local es = dtype_size[dtype]
  local t = tree:add(f.payload, tvb(off, len))
  t:set_text(string.format("Sparse payload: %d bytes", len))
  if not es then
    t:add_proto_expert_info(ef.malformed, "sparse payload of an unknown dtype")
    return
  end
  local pair = 4 + es
  local n = math.floor(len / pair)
  t:add(f.sparse_pairs, n):set_generated()
  for i = 0, math.min(n, max_items()) - 1 do
    local p = off + i * pair
    local st = t:add(tvb(p, pair), string.format("Pair %d: index %d", i, tvb(p, 4):uint()))
    st:add(f.sparse_index, tvb(p, 4))
    add_element(st, dtype, tvb(p + 4, es))
  end
  if n > max_items() then t:add(string.format("... %d more pairs", n - max_items())) end
  if len % pair ~= 0 then t:add_proto_expert_info(ef.malformed, "not a whole number of (index, value) pairs") end
end

local function raw_data(tvb, tree, off, len, name)
  if len == 0 then return end
  tree:add(f.data, tvb(off, len)):set_text(data_text(tvb, off, len, name))
end

local function expect_len(tvb, tree, off, len, want, what)
  if len ~= want then
    tree:add_proto_expert_info(ef.malformed, string.format("%s: %d bytes, expected %d", what, len, want))
    if len > 0 then tree:add(f.payload, tvb(off, len)) end
    return false
  end
  return true
end

local function name_field(tvb, tree, off, len)
  if len < 1 then return 0 end
  local n = tvb(off, 1):uint()
  tree:add(f.pool_name_len, tvb(off, 1))
  if 1 + n > len then
    tree:add_proto_expert_info(ef.malformed, "name runs past the payload")
    return len
  end
  if n > 0 then tree:add(f.pool_name, tvb(off + 1, n)) end
  return 1 + n
end

------------------------------------------------------- payload decoders ----

-- A fixed-layout record: each entry is {field, offset, size}; "le" as a
-- fourth element for the little-endian memory values (atomics).
local function add_layout(tree, tvb, off, layout)
  for _, e in ipairs(layout) do
    local r = tvb(off + e[2], e[3])
    if e[4] == "le" then tree:add_le(e[1], r) else tree:add(e[1], r) end
  end
end

-- A flags field and its bits, all over range r; returns the flags item.
local function add_bits(tree, field, r, bits)
  local item = tree:add(field, r)
  for _, b in ipairs(bits) do item:add(b, r) end
  return item
end

local function region_record(tvb, tree, off)
  local t = tree:add(f.region, tvb(off, 24))
  add_layout(t, tvb, off, {{f.region_base, 0, 8}, {f.region_size, 8, 8}, {f.region_key, 16, 4}})
  add_bits(t, f.region_perms, tvb(off + 20, 4), {f.rp_read, f.rp_write, f.rp_plain})
  t:append_text(string.format(": key 0x%x, base 0x%x, %s bytes", tvb(off + 16, 4):uint(),
                              tostring(tvb(off, 8):uint64()), tostring(tvb(off + 8, 8):uint64())))
end

local function pool_record(tvb, tree, off, len)
  if len < 36 then
    tree:add_proto_expert_info(ef.malformed, "allocation record shorter than 36 bytes")
    return len
  end
  local n = tvb(off + 32, 1):uint()
  local size = math.min(36 + n, len)
  local t = tree:add(f.pool_record, tvb(off, size))
  add_layout(t, tvb, off, {{f.pool_base, 0, 8}, {f.pool_size, 8, 8}, {f.pool_key, 16, 8}, {f.pool_stripe, 24, 4},
                           {f.pool_policy, 28, 1}, {f.pool_copies, 29, 1}, {f.pool_devices, 30, 1},
                           {f.pool_state, 31, 1}, {f.pool_name_len, 32, 1}, {f.pool_reserved, 33, 3}})
  if 36 + n > len then
    t:add_proto_expert_info(ef.malformed, "name runs past the payload")
  elseif n > 0 then
    t:add(f.pool_name, tvb(off + 36, n))
    t:append_text(": " .. tvb(off + 36, n):string())
  end
  return size
end

local function pool_map(tvb, tree, off, len)
  if len < 24 then return tree:add_proto_expert_info(ef.malformed, "translation table shorter than 24 bytes") end
  add_layout(tree, tvb, off, {{f.pool_base, 0, 8}, {f.pool_size, 8, 8}, {f.pool_stripe, 16, 4}, {f.pool_copies, 20, 1},
                              {f.pool_slots, 21, 1}, {f.pool_state, 22, 1}, {f.pool_reserved, 23, 1}})
  local slots = tvb(off + 21, 1):uint()
  if len ~= 24 + 24 * slots then
    tree:add_proto_expert_info(ef.malformed, "payload is not 24 + 24 x slots bytes")
  end
  for i = 0, slots - 1 do
    local s = off + 24 + 24 * i
    if s + 24 > off + len then break end
    local t = tree:add(f.pool_slot, tvb(s, 24))
    t:append_text(string.format(" %d: %s:%d", i, tostring(tvb(s, 4):ipv4()), tvb(s + 4, 2):uint()))
    add_layout(t, tvb, s, {{f.slot_ip, 0, 4}, {f.slot_port, 4, 2}})
    add_bits(t, f.slot_flags, tvb(s + 6, 1), {f.slot_live, f.slot_lost})
    add_layout(t, tvb, s, {{f.pool_reserved, 7, 1}, {f.slot_boot, 8, 4}, {f.slot_rkey, 12, 4}, {f.slot_base, 16, 8}})
  end
end

local function pool_stat(tvb, tree, off, len)
  if len < 24 then return tree:add_proto_expert_info(ef.malformed, "pool statistics shorter than 24 bytes") end
  add_layout(tree, tvb, off, {{f.pool_capacity, 0, 8}, {f.pool_used, 8, 8}, {f.pool_allocations, 16, 4},
                              {f.pool_device_count, 20, 4}})
  local n = tvb(off + 20, 4):uint()
  if len ~= 24 + 40 * n then
    tree:add_proto_expert_info(ef.malformed, "payload is not 24 + 40 x devices bytes")
  end
  for i = 0, n - 1 do
    local d = off + 24 + 40 * i
    if d + 40 > off + len then break end
    local t = tree:add(f.pool_device, tvb(d, 40))
    t:append_text(string.format(" %d: %s:%d", i, tostring(tvb(d, 4):ipv4()), tvb(d + 4, 2):uint()))
    add_layout(t, tvb, d, {{f.dev_ip, 0, 4}, {f.dev_port, 4, 2}, {f.dev_state, 6, 1}, {f.pool_reserved, 7, 1},
                           {f.dev_boot, 8, 4}, {f.pool_reserved, 12, 4}, {f.dev_capacity, 16, 8}, {f.dev_used, 24, 8},
                           {f.dev_largest_free, 32, 8}})
  end
end

-- Every entry, unlike elements: a page has a few hundred at most, and
-- filtering on a counter's name is why one looks at STATS.
local function stats_page(tvb, tree, off, len)
  local p, n = off, 0
  local stop = off + len
  while p < stop do
    local nl = tvb(p, 1):uint()
    if p + 1 + nl + 8 > stop then
      tree:add_proto_expert_info(ef.malformed, "STATS entry runs past the payload")
      break
    end
    local t = tree:add(f.stats_entry, tvb(p, 1 + nl + 8))
    t:set_text(string.format("%s = %s", tvb(p + 1, nl):string(), tostring(tvb(p + 1 + nl, 8):uint64())))
    t:add(f.stats_name, tvb(p + 1, nl))
    t:add(f.stats_value, tvb(p + 1 + nl, 8))
    n = n + 1
    p = p + 1 + nl + 8
  end
  tree:add(f.stats_entries, n):set_generated()
end

local function opt_config(tvb, tree, off, len)
  if not expect_len(tvb, tree, off, len, 80, "OPT_CONFIG record") then return end
  tree:add(f.opt_kind, tvb(off, 1))
  add_bits(tree, f.opt_flags, tvb(off + 1, 1), {f.opt_nesterov})
  add_layout(tree, tvb, off, {{f.opt_reserved, 2, 6}, {f.opt_step, 8, 8}, {f.opt_lr, 16, 8}, {f.opt_wd, 24, 8},
                              {f.opt_m1, 32, 8}, {f.opt_m2, 40, 8}, {f.opt_eps, 48, 8}, {f.opt_scale, 56, 8},
                              {f.opt_state1, 64, 8}, {f.opt_state2, 72, 8}})
end

local function agg_request(tvb, tree, off, len, dtype)
  if len < 16 then
    return tree:add_proto_expert_info(ef.malformed, "AGGREGATE payload shorter than its 16-byte record")
  end
  local t = tree:add(tvb(off, 16), "Aggregation record")
  add_layout(t, tvb, off, {{f.agg_contributor, 0, 2}, {f.agg_contributors, 2, 2}, {f.agg_stride, 4, 4}})
  add_bits(t, f.agg_flags, tvb(off + 8, 4), {f.agg_zero, f.agg_no_result, f.agg_skip, f.agg_staged,
                                                 f.agg_optimize, f.agg_quiet})
  t:add(f.agg_weights, tvb(off + 12, 4))
  t:append_text(string.format(": contributor %d of %d", tvb(off, 2):uint(), tvb(off + 2, 2):uint()))
  if len > 16 then dense_elements(tvb, tree, off + 16, len - 16, dtype, "Block") end
end

local function agg_answer(tvb, tree, off, len, dtype)
  if len < 8 then
    return tree:add_proto_expert_info(ef.malformed, "AGGREGATE answer shorter than its 8-byte record")
  end
  local t = tree:add(tvb(off, 8), "Aggregation answer record")
  t:add(f.agg_generation, tvb(off, 4))
  add_bits(t, f.agg_answer_flags, tvb(off + 4, 4), {f.agg_result_zero, f.agg_none, f.agg_held, f.agg_group})
  -- A held answer's data: the contributors the block holds (bit r).
  if band(tvb(off + 4, 4):uint(), 0x4) ~= 0 and len == 16 then
    tree:add(f.agg_held_set, tvb(off + 8, 8))
  elseif len > 8 then
    dense_elements(tvb, tree, off + 8, len - 8, dtype, "Result")
  end
end

-- Element payload of WRITE, REDUCE_*, OPT_STEP (dense or sparse).
local function element_payload(tvb, tree, off, len, dtype, sparse, name)
  if len == 0 then return end
  if sparse then return sparse_elements(tvb, tree, off, len, dtype) end
  dense_elements(tvb, tree, off, len, dtype, name)
end

-- A request's payload, decoded for `op` (the header's opcode, or the opcode
-- of the segment being executed in a chain).
local function request_payload(tvb, tree, off, len, op, h)
  if op == OP.WRITE then
    -- dtype matters to a WRITE only when sparse, but a typed chain's
    -- elements are easier read as numbers.
    if h.sparse then return sparse_elements(tvb, tree, off, len, h.dtype) end
    if h.dtype ~= 0 then return dense_elements(tvb, tree, off, len, h.dtype) end
    return raw_data(tvb, tree, off, len)
  elseif op == OP.REDUCE_MEM or op == OP.REDUCE_PAYLOAD or op == OP.OPT_STEP then
    return element_payload(tvb, tree, off, len, h.dtype, h.sparse)
  elseif op == OP.FILL then
    tree:add(f.fill_pattern, tvb(off, len)):append_text(string.format(" (%d bytes)", len))
  elseif op == OP.COPY then
    if not expect_len(tvb, tree, off, len, 16, "COPY descriptor") then return end
    add_layout(tree, tvb, off, {{f.copy_src_addr, 0, 8}, {f.copy_src_key, 8, 4}, {f.copy_reserved, 12, 4}})
  elseif op == OP.ARM then
    if expect_len(tvb, tree, off, len, 4, "ARM generation") then tree:add(f.arm_generation, tvb(off, 4)) end
  elseif op == OP.FETCH_ADD then
    if expect_len(tvb, tree, off, len, 8, "addend") then tree:add_le(f.at_addend, tvb(off, 8)) end
  elseif op == OP.SWAP then
    if expect_len(tvb, tree, off, len, 8, "new value") then tree:add_le(f.at_new, tvb(off, 8)) end
  elseif op == OP.COMPARE_SWAP then
    if not expect_len(tvb, tree, off, len, 16, "expected and desired") then return end
    add_layout(tree, tvb, off, {{f.at_expected, 0, 8, "le"}, {f.at_desired, 8, 8, "le"}})
  elseif op == OP.OPT_CONFIG then
    opt_config(tvb, tree, off, len)
  elseif op == OP.AGGREGATE then
    agg_request(tvb, tree, off, len, h.dtype)
  elseif op == OP.REGION_ADD then
    if expect_len(tvb, tree, off, len, 24, "region record") then region_record(tvb, tree, off) end
  elseif op == OP.REGION_DEL then
    if expect_len(tvb, tree, off, len, 4, "region key") then tree:add(f.region_key, tvb(off, 4)) end
  elseif op == OP.POOL_ALLOC then
    if len < 17 then return tree:add_proto_expert_info(ef.malformed, "POOL_ALLOC payload shorter than 17 bytes") end
    add_layout(tree, tvb, off, {{f.pool_size, 0, 8}, {f.pool_stripe, 8, 4}, {f.pool_policy, 12, 1},
                                {f.pool_devices, 13, 1}, {f.pool_first_device, 14, 2}})
    name_field(tvb, tree, off + 16, len - 16)
  elseif op == OP.POOL_FREE or op == OP.POOL_LOOKUP then
    name_field(tvb, tree, off, len)
  else
    -- READ, PING, STATS, REGION_LIST and the other pool requests carry none.
    local t = tree:add(f.payload, tvb(off, len))
    t:add_proto_expert_info(ef.unexpected)
  end
end

local function answer_payload(tvb, tree, off, len, op, h)
  if op == OP.PING then
    if not expect_len(tvb, tree, off, len, 32, "PING info") then return end
    add_layout(tree, tvb, off, {{f.ping_boot_id, 0, 4}, {f.ping_max_payload, 4, 4}, {f.ping_memory, 8, 8},
                                {f.ping_regions, 16, 4}, {f.ping_window, 20, 4}, {f.ping_version, 24, 1}})
    add_bits(tree, f.ping_flags, tvb(off + 25, 1), {f.ping_pool_proxy})
    add_layout(tree, tvb, off, {{f.ping_reserved, 26, 2}, {f.ping_cookie, 28, 4}})
  elseif op == OP.STATS then
    stats_page(tvb, tree, off, len)
  elseif op == OP.READ then
    raw_data(tvb, tree, off, len)
  elseif op == OP.REDUCE_PAYLOAD or op == OP.OPT_STEP then
    dense_elements(tvb, tree, off, len, op == OP.OPT_STEP and 1 or h.dtype, "Result")
  elseif op == OP.ARM then
    if expect_len(tvb, tree, off, len, 4, "previous generation") then tree:add(f.arm_previous, tvb(off, 4)) end
  elseif op == OP.FETCH_ADD or op == OP.SWAP or op == OP.COMPARE_SWAP then
    if expect_len(tvb, tree, off, len, 8, "previous value") then tree:add_le(f.at_old, tvb(off, 8)) end
  elseif op == OP.REGION_LIST then
    local n = math.floor(len / 24)
    tree:add(f.region_count, n):set_generated()
    for i = 0, n - 1 do region_record(tvb, tree, off + 24 * i) end
    if len % 24 ~= 0 then tree:add_proto_expert_info(ef.malformed, "not a whole number of 24-byte records") end
  elseif op == OP.AGGREGATE then
    agg_answer(tvb, tree, off, len, h.dtype)
  elseif op == OP.POOL_ALLOC or op == OP.POOL_LOOKUP then
    pool_record(tvb, tree, off, len)
  elseif op == OP.POOL_LIST then
    local p, n = off, 0
    while p < off + len do
      p = p + pool_record(tvb, tree, p, off + len - p)
      n = n + 1
    end
    tree:add(f.pool_records, n):set_generated()
  elseif op == OP.POOL_MAP then
    pool_map(tvb, tree, off, len)
  elseif op == OP.POOL_STAT then
    pool_stat(tvb, tree, off, len)
  elseif op == OP.CHAIN then
    -- The answering segment's opcode is unknown without the request; its
    -- payload is then element data if typed, else bytes.
    if h.dtype ~= 0 then dense_elements(tvb, tree, off, len, h.dtype, "Result")
    else raw_data(tvb, tree, off, len) end
  else
    tree:add(f.payload, tvb(off, len)):add_proto_expert_info(ef.unexpected)
  end
end

--------------------------------------------------- request/answer matching --

-- Filled on the first pass; an answer echoes txn and opcode (3.1). The
-- key includes the client's address: txns are per socket (9.1).
local requests, answers = {}, {}

function netdam.init()
  requests, answers = {}, {}
end

local function txn_key(addr, port, h)
  return string.format("%s:%d/%s/%d", tostring(addr), port, tostring(h.txn), h.opcode)
end

---------------------------------------------------------------- dissector --

local function segment_tree(tvb, tree, off, i, current)
  local t = tree:add(f.seg, tvb(off, SEGMENT))
  local op = tvb(off + 6, 1):uint()
  t:set_text(string.format("Segment %d%s: %s %s:%d key 0x%x addr 0x%s", i, current and " (current)" or "",
                           opcode_names[op] or string.format("0x%02x", op), tostring(tvb(off, 4):ipv4()),
                           tvb(off + 4, 2):uint(), tvb(off + 8, 4):uint(), tvb(off + 16, 8):uint64():tohex()))
  add_layout(t, tvb, off, {{f.seg_ip, 0, 4}, {f.seg_port, 4, 2}, {f.seg_opcode, 6, 1}})
  add_bits(t, f.seg_flags, tvb(off + 7, 1), {f.sf_gen, f.sf_skip_stale, f.sf_stamp, f.sf_await, f.sf_reserved})
  add_layout(t, tvb, off, {{f.seg_rkey, 8, 4}, {f.seg_aux, 12, 4}, {f.seg_addr, 16, 8}})
  return op
end

local function dissect(tvb, pinfo, root)
  local n = tvb:len()
  pinfo.cols.protocol = "netdam"
  local tree = root:add(netdam, tvb())
  if n < HEADER + TRAILER then
    tree:add_proto_expert_info(ef.malformed, string.format("%d bytes: shorter than header and trailer", n))
    pinfo.cols.info = "netdam (truncated)"
    return n
  end
  local body = n - TRAILER

  local h = {
    opcode = tvb(5, 1):uint(), flags = tvb(6, 1):uint(), status = tvb(7, 1):uint(),
    dtype = tvb(8, 1):uint(), redop = tvb(9, 1):uint(), seg_count = tvb(10, 1):uint(),
    seg_index = tvb(11, 1):uint(), txn = tvb(16, 8):uint64(), length = tvb(32, 4):uint(),
  }
  h.response = band(h.flags, 0x01) ~= 0
  -- An answer's byte 10 is the sender's queue depth (PROTOCOL.md 3.1).
  if h.response then h.depth, h.seg_count = h.seg_count, 0 end
  h.sparse = band(h.flags, 0x04) ~= 0

  local ht = tree:add(tvb(0, HEADER), "Header")
  add_layout(ht, tvb, 0, {{f.magic, 0, 4}, {f.version, 4, 1}, {f.opcode, 5, 1}})
  local fl = add_bits(ht, f.flags, tvb(6, 1), {f.fl_response, f.fl_ack_req, f.fl_sparse, f.fl_sparse_ok, f.fl_direct, f.fl_gather, f.fl_reserved})
  local st = ht:add(f.status, tvb(7, 1))
  add_layout(ht, tvb, 0, {{f.dtype, 8, 1}, {f.redop, 9, 1}, {h.response and f.depth or f.seg_count, 10, 1}, {f.seg_index, 11, 1},
                          {f.rkey, 12, 4}, {f.txn, 16, 8}, {f.addr, 24, 8}, {f.length, 32, 4}, {f.boot, 36, 4}})
  tree:add(f.is_response, h.response):set_generated()
  if tvb(0, 4):uint() ~= MAGIC then ht:add_proto_expert_info(ef.malformed, "wrong magic") end
  if band(h.flags, 0xE0) ~= 0 then fl:add_proto_expert_info(ef.unexpected, "reserved flag bits set: BAD_FLAGS") end
  if h.seg_count > 32 then ht:add_proto_expert_info(ef.malformed, "more than 32 segments: BAD_SEGMENT") end

  local opname = opcode_names[h.opcode] or string.format("opcode 0x%02x", h.opcode)
  local info = string.format("%s %s txn=%s", opname, h.response and "answer" or "request", tostring(h.txn))

  -- Routing header (3.3, 3.4).
  local off = HEADER
  local seg_ops = {}
  if h.seg_count > 0 then
    local need = HEADER + PREAMBLE + SEGMENT * h.seg_count
    if need > body then
      tree:add_proto_expert_info(ef.malformed, string.format("%d segments do not fit the datagram", h.seg_count))
      off = body
    else
      local pt = tree:add(tvb(off, PREAMBLE), "Segment-routing preamble")
      add_layout(pt, tvb, off, {{f.sr_reply_ip, 0, 4}, {f.sr_reply_port, 4, 2}, {f.sr_flags, 6, 2},
                                {f.sr_generation, 8, 4}, {f.sr_reserved, 12, 4}})
      if tvb(off, 4):uint() == 0 then pt:append_text(": reply to the source") end
      local names = {}
      for i = 0, h.seg_count - 1 do
        local s = HEADER + PREAMBLE + SEGMENT * i
        seg_ops[i] = segment_tree(tvb, tree, s, i, i == h.seg_index)
        names[#names + 1] = opcode_names[seg_ops[i]] or "?"
      end
      info = info .. string.format(" seg %d/%d [%s]", h.seg_index, h.seg_count, table.concat(names, " > "))
      off = need
    end
  end

  -- Matching (first pass records; every pass shows).
  -- A chain that names its reply-to (a pool proxy's DIRECT forward, a
  -- result group's probe) is answered there: match it by that address.
  local key
  if h.response then
    key = txn_key(pinfo.dst, pinfo.dst_port, h)
  elseif h.seg_count > 0 and off > HEADER and tvb(HEADER, 4):uint() ~= 0 then
    key = txn_key(tvb(HEADER, 4):ipv4(), tvb(HEADER + 4, 2):uint(), h)
  else
    key = txn_key(pinfo.src, pinfo.src_port, h)
  end
  if not pinfo.visited then
    if h.response then
      if not answers[key] then answers[key] = pinfo.number end
    elseif not requests[key] then
      requests[key] = { frame = pinfo.number, seg_ops = seg_ops }
    end
  end
  local req = requests[key]
  if h.response then
    if req and req.frame < pinfo.number then tree:add(f.request_in, req.frame):set_generated() end
  elseif answers[key] and answers[key] > pinfo.number then
    tree:add(f.response_in, answers[key]):set_generated()
  end

  -- Payload (section 6, 17).
  local plen = body - off
  if plen > 0 then
    local pt = tree:add(tvb(off, plen), string.format("Payload (%d bytes)", plen))
    pt:add(f.payload_len, plen):set_generated()
    if h.response then
      if h.status ~= 0 then
        pt:add_proto_expert_info(ef.unexpected, "a NAK carries no payload")
      else
        local op = h.opcode
        if op == OP.CHAIN and req and req.seg_ops[h.seg_index] then op = req.seg_ops[h.seg_index] end
        answer_payload(tvb, pt, off, plen, op, h)
      end
    else
      local op = h.opcode
      if op == OP.CHAIN and seg_ops[h.seg_index] then op = seg_ops[h.seg_index] end
      request_payload(tvb, pt, off, plen, op, h)
    end
  end

  if h.response then
    if h.opcode == OP.CHAIN then info = info .. " seg " .. h.seg_index end
    local sname = status_names[h.status] or string.format("status %d", h.status)
    if h.status ~= 0 then
      st:add_proto_expert_info(ef.nak, "NAK " .. sname)
      info = info .. " NAK " .. sname
    else
      info = info .. " OK"
    end
  end
  if h.seg_count == 0 and h.length > 0 then info = info .. " len=" .. h.length end

  -- Integrity trailer (3.5): checked first by every receiver, so a bad one
  -- is what a reader of a capture most needs to see.
  local want = tvb(body, 4):uint()
  local got = crc32c(tvb:raw(0, body))
  local ct = tree:add(f.crc, tvb(body, 4))
  tree:add(f.crc_computed, got):set_generated()
  local good = want == got
  tree:add(f.crc_status, good and 1 or 0):set_generated()
  if good then
    ct:append_text(" [correct]")
  else
    ct:append_text(string.format(" [incorrect, should be 0x%08x]", got))
    ct:add_proto_expert_info(ef.crc_bad)
    info = info .. " [BAD CRC]"
  end

  pinfo.cols.info = info
  return n
end

function netdam.dissector(tvb, pinfo, tree)
  if tvb:len() >= 4 and tvb(0, 4):uint() ~= MAGIC then return 0 end
  return dissect(tvb, pinfo, tree)
end

-- Clients and tests use kernel-chosen ports; the magic at offset 0 of every
-- datagram tells netdam apart.
local function heuristic(tvb, pinfo, tree)
  if tvb:len() < HEADER + TRAILER or tvb(0, 4):uint() ~= MAGIC then return false end
  dissect(tvb, pinfo, tree)
  return true
end
netdam:register_heuristic("udp", heuristic)

local udp_port = DissectorTable.get("udp.port")
udp_port:add_for_decode_as(netdam)
local registered = nil
local function apply_ports()
  if registered then udp_port:remove(registered, netdam) end
  registered = netdam.prefs.ports
  udp_port:add(registered, netdam)
end
function netdam.prefs_changed() apply_ports() end
apply_ports()
