# Session 17: CIERA's one-kernel (decoupled look-back) encodes against the production split + prefix sum + gather,
# compare and hash modes (benchmarks/diag_ciera_split.py; every variant checked byte for byte first). Each call ran
# the script's LOOKBACK_VARIANTS of its commit (results/gpu/README.md, session 17):
#   call 1: relaxed publishing, look-back windows of 32/256/1024 tiles, tiles of 4096/8192 values;
#   call 2 (CALL=_reload): the tile re-read after the walk instead of held across it, warps 4/8/16, tiles to 16384;
#   call 3 (CALL=_oracle): tiles to 65536, program ids for tickets, the oracle bound (prefixes given, no walk);
#   call 4 (CALL=_tiles): _encode_tiles, persistent programs over tiles of SUB production-shaped sub-tiles.
#   rm -rf /tmp/res; source scripts/gpu/setup_device.sh && bash scripts/gpu/ciera_single_pass.sh
timeout 400 python3 benchmarks/diag_ciera_split.py --lrs 1e-4,1e-5,1e-6 --out $RES/ciera_single_pass${CALL:-}.json 2>&1 \
  | grep -E "^lr|Error|error" | tr ',' '\n'
