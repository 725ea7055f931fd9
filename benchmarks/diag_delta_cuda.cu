// Diagnostic: the delta codec's block kernels (B = 256) written in CUDA C++ with warp intrinsics, to measure what
// the Triton kernels' integer work costs (docs/delta.md: "a CUDA kernel with warp intrinsics ...").
// Same inputs and outputs as kernels/delta.py's _encode_kernel and _decode_kernel (plain shards, one payload), so
// the rest of the codec (prefix sums, record gather) runs unchanged around them and the payload
// bytes can be compared with the production path. benchmarks/diag_delta_cuda.py compiles it (NVRTC through CuPy
// on the GPU; g++ with diag_delta_cuda_emu.h on the CPU, the warp intrinsics emulated) and checks and times it.
//
// A warp codes one block of 256 values; lane l holds the block's row l (values 8l .. 8l + 7, one 16-byte load).
// Cross-lane work per block, encode: six reductions (the escape counts of widths 1..7 as 16-bit fields in four, the
// largest v, the changed count), one warp scan (counts and escapes in two 16-bit fields), shared-memory ORs of each
// row's packed bits (at most three words a row); decode: two warp scans (counts, then escapes).

#ifndef DELTA_EMULATE
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short u16;
typedef unsigned char u8;
#define FULL_MASK 0xffffffffu
#endif

#ifndef STAGE
#define STAGE 3  // timing variants (outputs not valid below 3): 1 = loads, z, bitmap, stores only; 2 = + width
#endif
#define BLOCK 256
#define WARPS 8             // blocks (warps) per CTA
#define STREAM_WORDS 136    // ceil(17 * BLOCK / 32): every value at 17 bits
#define RECORD_WORDS 144    // BLOCK / 32 bitmap words + STREAM_WORDS (kernels/delta.py's record row)

__device__ __forceinline__ u32 ordered(u32 u) {  // 16-bit pattern -> monotone 0..65535 (kernels/delta.py)
  return u ^ (((u >> 15) * 0x7FFFu) | 0x8000u);
}

__device__ __forceinline__ u32 from_ordered(u32 o) {
  return (o ^ ((((o >> 15) ^ 1u) * 0x7FFFu) | 0x8000u)) & 0xFFFFu;
}

__device__ __forceinline__ u32 bit_length(u32 x) { return 32u - __clz(x); }

__device__ __forceinline__ u32 warp_exclusive_scan(u32 x, int lane) {
  u32 incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    u32 t = __shfl_up_sync(FULL_MASK, incl, o);
    if (lane >= o) incl += t;
  }
  return incl - x;
}

__device__ __forceinline__ void or_bits(u32* words, u32 bitpos, u32 value, u32 width) {  // width <= 32
  u32 wi = bitpos >> 5, sh = bitpos & 31;
  atomicOr(words + wi, value << sh);
  if (sh + width > 32) atomicOr(words + wi + 1, value >> (32 - sh));
}

__device__ __forceinline__ u32 read_bits(const u32* words, u64 bitpos, u32 width) {  // width <= 25
  u64 wi = bitpos >> 5;
  u32 sh = (u32)(bitpos & 31);
  u32 lo = words[wi];
  u32 hi = (sh + width > 32) ? words[wi + 1] : 0u;
  u32 v = sh ? ((lo >> sh) | (hi << (32 - sh))) : lo;
  return v & ((1u << width) - 1u);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
delta_encode(u16* __restrict__ prev, const u16* __restrict__ newv, i64 numel, u8* __restrict__ codes,
             i64* __restrict__ changed_out, int* __restrict__ counts_out, int* __restrict__ n_esc_out,
             u8* __restrict__ exc_widths_out, i64* __restrict__ nbytes_out, u32* __restrict__ records, i64 n_blocks) {
  __shared__ u32 stream_s[WARPS][STREAM_WORDS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 b = (i64)blockIdx.x * WARPS + warp;
  if (b >= n_blocks) return;
  const i64 first = b * BLOCK + lane * 8;  // numel % 8 == 0: a row is whole or absent
  const bool inside = first < numel;
  uint4 nw = make_uint4(0, 0, 0, 0), ow = make_uint4(0, 0, 0, 0);
  if (inside) {
    nw = *reinterpret_cast<const uint4*>(newv + first);
    ow = *reinterpret_cast<const uint4*>(prev + first);
    *reinterpret_cast<uint4*>(prev + first) = nw;  // the lane's own row: no other lane reads it
  }
  const u32 nv[4] = {nw.x, nw.y, nw.z, nw.w}, ov[4] = {ow.x, ow.y, ow.z, ow.w};
  u32 v[8];
  u32 bm = 0, vmax = 0, hist = 0;
#pragma unroll
  for (int j = 0; j < 8; j++) {
    u32 un = (nv[j >> 1] >> (16 * (j & 1))) & 0xFFFFu, uo = (ov[j >> 1] >> (16 * (j & 1))) & 0xFFFFu;
    int d = (int)ordered(un) - (int)ordered(uo);
    u32 z = ((u32)d << 1) ^ (u32)(d >> 31);
    v[j] = z - 1;
    if (z) {
      bm |= 1u << j;
      vmax = max(vmax, z - 1);
      // n_esc(w) = values with bit_length(z) > w: nibble w - 1 (w = 1..7) counts them
      if (STAGE >= 2) {
        u32 k = min(bit_length(z), 8u) - 1;
        hist += 0x11111111u & ((1u << (4 * k)) - 1u);
      }
    }
  }
  const u32 cnt = __popc(bm);
  const u32 total = __reduce_add_sync(FULL_MASK, cnt);
  u32 xw = 0, width = 0, n_esc = 0, nbits = 0;  // STAGE 1: no width, no stream
  if (STAGE >= 2) {
    xw = bit_length(__reduce_max_sync(FULL_MASK, vmax));
    const u32 h0 = __reduce_add_sync(FULL_MASK, hist & 0x000F000Fu);          // w = 1 | w = 5
    const u32 h1 = __reduce_add_sync(FULL_MASK, (hist >> 4) & 0x000F000Fu);   // w = 2 | w = 6
    const u32 h2 = __reduce_add_sync(FULL_MASK, (hist >> 8) & 0x000F000Fu);   // w = 3 | w = 7
    const u32 h3 = __reduce_add_sync(FULL_MASK, (hist >> 12) & 0x000F000Fu);  // w = 4
    const u32 n_esc_of[8] = {0, h0 & 0xFFFFu, h1 & 0xFFFFu, h2 & 0xFFFFu, h3 & 0xFFFFu, h0 >> 16, h1 >> 16, h2 >> 16};
    u32 best = total + xw * n_esc_of[1];
    width = 1;
    n_esc = n_esc_of[1];
#pragma unroll
    for (u32 w = 2; w <= 7; w++) {
      u32 cost = total * w + xw * n_esc_of[w];
      if (cost < best) { best = cost; width = w; n_esc = n_esc_of[w]; }
    }
    if (total * 17 < best) { best = total * 17; width = 17; n_esc = 0; }
    if (xw == 0) { width = 0; n_esc = 0; best = 0; }
    if (STAGE >= 3) nbits = best;  // total * width + xw * n_esc; STAGE 2: no stream
  }
  const u32 nwords = (nbits + 31) >> 5;
  u32* words = stream_s[warp];
  if (STAGE >= 3) {
    for (u32 i = lane; i < nwords; i += 32) words[i] = 0;
    __syncwarp();
    const u32 mask = (1u << width) - 1u;
    u32 esc = 0;
    if (width >= 1 && width <= 7) {
#pragma unroll
      for (int j = 0; j < 8; j++) esc |= (((bm >> j) & 1u) && v[j] >= mask) ? (1u << j) : 0u;
    }
    const u32 scan = warp_exclusive_scan(cnt | (__popc(esc) << 16), lane);
    const u32 slot0 = scan & 0xFFFFu, esc0 = scan >> 16;
    if (width >= 1 && width <= 7 && cnt) {  // the row's slots, at most 56 bits, packed in the thread
      u64 row = 0;
      u32 s = 0;
#pragma unroll
      for (int j = 0; j < 8; j++) {
        if ((bm >> j) & 1u) {
          row |= (u64)min(v[j], mask) << s;
          s += width;
        }
      }
      u32 p = slot0 * width, wi = p >> 5, sh = p & 31;
      u64 lo = row << sh;
      u32 hi = sh ? (u32)(row >> (64 - sh)) : 0u;
      if ((u32)lo) atomicOr(words + wi, (u32)lo);
      if ((u32)(lo >> 32)) atomicOr(words + wi + 1, (u32)(lo >> 32));
      if (hi) atomicOr(words + wi + 2, hi);
      if (esc) {  // the exception list after all slots, in order
        u32 e = total * width + esc0 * xw;
#pragma unroll
        for (int j = 0; j < 8; j++) {
          if ((esc >> j) & 1u) {
            or_bits(words, e, v[j], xw);
            e += xw;
          }
        }
      }
    } else if (width == 17 && cnt) {  // never escapes
      u32 p = slot0 * 17;
#pragma unroll
      for (int j = 0; j < 8; j++) {
        if ((bm >> j) & 1u) {
          or_bits(words, p, v[j], 17);
          p += 17;
        }
      }
    }
    __syncwarp();
  }
  u32* rec = records + b * RECORD_WORDS;
  reinterpret_cast<u8*>(rec)[lane] = (u8)bm;
  for (u32 i = lane; i < nwords; i += 32) rec[BLOCK / 32 + i] = words[i];
  if (lane == 0) {
    const u32 code = total ? width + 1 : 0;
    codes[b] = (u8)code;
    changed_out[b] = code != 0;
    counts_out[b] = (int)total;
    n_esc_out[b] = (int)n_esc;
    exc_widths_out[b] = (u8)xw;
    nbytes_out[b] = (nbits + 7) >> 3;
  }
}

// payload: 4-byte aligned, readable 3 bytes past its end; its sections as compression/delta.py lays them out: the
// codes at codes_at, n_changed (u32) at n_changed_at, then the group entries from groups_at, and offsets,
// exc_widths, bitmaps, value streams. (Session 21 also timed a variant that staged each block's stream in shared
// memory: 5-7% slower; format 3 no longer carries the stream sizes it needed.)
#define GROUP 64  // kernels.delta.group_blocks(256)

__device__ __forceinline__ u32 load_u32(const u8* p) {  // little-endian, any byte offset
  return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
delta_decode(u16* __restrict__ out, i64 numel, const u8* __restrict__ payload, i64 codes_at, i64 n_changed_at,
             i64 groups_at, i64 n_blocks) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 b = (i64)blockIdx.x * WARPS + warp;
  if (b >= n_blocks) return;
  const i64 first = b * BLOCK + lane * 8;
  const bool inside = first < numel;
  const u32 code = payload[codes_at + b];
  if (!code) return;  // warp-uniform
  // the block's record: its group's entry plus the changed blocks of the group before it (two codes a lane)
  const i64 group_start = b - b % GROUP, k0 = group_start + lane, k1 = k0 + 32;
  const u32 earlier = (k0 < b && payload[codes_at + k0]) + (k1 < b && payload[codes_at + k1]);
  const u8* entry = payload + groups_at + 8 * (b / GROUP);
  const i64 n_changed = load_u32(payload + n_changed_at);
  const i64 offsets_at = groups_at + 8 * ((n_blocks + GROUP - 1) / GROUP);
  const i64 exc_widths_at = offsets_at + 2 * n_changed, bitmaps_at = exc_widths_at + n_changed;
  const i64 values_at = bitmaps_at + n_changed * (BLOCK / 8);
  const i64 rank = load_u32(entry) + __reduce_add_sync(FULL_MASK, earlier);
  const u8* offset = payload + offsets_at + 2 * rank;
  const i64 stream_at = load_u32(entry + 4) + (offset[0] | (offset[1] << 8));
  const u32 width = code - 1, mask = (1u << width) - 1u;
  const u32 xw = payload[exc_widths_at + rank];
  const u32 bm = payload[bitmaps_at + rank * (BLOCK / 8) + lane];
  const u32* words = reinterpret_cast<const u32*>(payload);
  const u64 stream_bit = (u64)(values_at + stream_at) * 8;
  const u32 cnt = __popc(bm);
  const u32 slot0 = warp_exclusive_scan(cnt, lane);
  const u32 total = __shfl_sync(FULL_MASK, slot0 + cnt, 31);
  u32 v[8];
  u32 esc = 0;
  if (STAGE == 1) {
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = 0;
  } else if (width >= 1 && width <= 7) {
    const u64 p = stream_bit + slot0 * width;
    const u32 need = (u32)(p & 31) + cnt * width, sh = (u32)(p & 31);
    const u64 wi = p >> 5;
    u32 w0 = cnt ? words[wi] : 0u, w1 = need > 32 ? words[wi + 1] : 0u, w2 = need > 64 ? words[wi + 2] : 0u;
    u64 row = (((u64)w1 << 32) | w0) >> sh;
    if (sh) row |= (u64)w2 << (64 - sh);
    u32 s = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      u32 slot = (u32)(row >> s) & mask;
      v[j] = slot;
      if ((bm >> j) & 1u) {
        s += width;
        if (slot == mask) esc |= 1u << j;
      }
    }
  } else if (width == 17) {
    u64 p = stream_bit + slot0 * 17;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      v[j] = ((bm >> j) & 1u) ? read_bits(words, p, 17) : 0u;
      if ((bm >> j) & 1u) p += 17;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = 0;
  }
  const u32 esc0 = warp_exclusive_scan(__popc(esc), lane);
  if (esc) {
    u64 e = stream_bit + (u64)total * width + (u64)esc0 * xw;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      if ((esc >> j) & 1u) {
        v[j] = read_bits(words, e, xw);
        e += xw;
      }
    }
  }
  if (!bm || !inside) return;
  const uint4 q = *reinterpret_cast<const uint4*>(out + first);
  u32 qv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 8; j++) {
    if ((bm >> j) & 1u) {
      u32 z = v[j] + 1;
      int d = (int)(z >> 1) ^ -(int)(z & 1);
      u32 sh = 16 * (j & 1);
      u32 u = from_ordered((u32)((int)ordered((qv[j >> 1] >> sh) & 0xFFFFu) + d));
      qv[j >> 1] = (qv[j >> 1] & ~(0xFFFFu << sh)) | (u << sh);
    }
  }
  *reinterpret_cast<uint4*>(out + first) = make_uint4(qv[0], qv[1], qv[2], qv[3]);
}
