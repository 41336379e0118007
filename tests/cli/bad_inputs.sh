#!/usr/bin/env bash
# Every malformed input to moe-generate ends with a non-zero exit and ONE line
# on stderr that names the file and the problem; nothing crashes (run under
# the sanitizer build too). The flags moe-generate shares with moe-worker
# (worker/group/launch.c) are checked on both.
#
#   tests/cli/bad_inputs.sh BUILD_BIN_DIR FIXTURES_DIR
set -uo pipefail
bindir=$1
bin=$bindir/moe-generate
fixtures=$2
tmp=$(mktemp -d /tmp/moe-bad-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0

# expect NAME SUBSTRING... -- ARGS...: moe-generate ARGS must fail with one
# stderr line containing every SUBSTRING.
expect() {
  local name=$1; shift
  local subs=()
  while [ "$1" != "--" ]; do subs+=("$1"); shift; done
  shift
  "$bin" "$@" >"$tmp/out" 2>"$tmp/err.all"
  local rc=$? ok=1 why=""
  # The backend's notice that it fell back to the CPU is information, not
  # part of the error.
  grep -v "using the CPU backend$" "$tmp/err.all" >"$tmp/err"
  local lines
  lines=$(wc -l <"$tmp/err")
  if [ $rc -eq 0 ]; then ok=0; why="exit 0"; fi
  if [ $rc -ge 128 ]; then ok=0; why="killed by signal $((rc - 128))"; fi
  if grep -qE "AddressSanitizer|runtime error|LeakSanitizer" "$tmp/err.all"; then ok=0; why="sanitizer report"; fi
  if [ "$lines" -ne 1 ]; then ok=0; why="$why; $lines stderr lines"; fi
  for s in "${subs[@]}"; do
    grep -qiF -- "$s" "$tmp/err" || { ok=0; why="$why; no '$s'"; }
  done
  if [ $ok = 1 ]; then
    pass=$((pass + 1)); echo "ok   $name: $(head -c 200 "$tmp/err")"
  else
    fail=$((fail + 1)); echo "FAIL $name ($why):"; head -c 2000 "$tmp/err"
  fi
}

# A fresh copy of a fixture model to damage.
copy() { rm -rf "$tmp/m"; cp -r "$fixtures/$1" "$tmp/m"; }

# Rewrites the JSON header of a safetensors file with a perl expression
# applied to it (fixing the length prefix).
st_edit() {
  perl -e '
    my ($file, $expr) = @ARGV;
    open(my $f, "<:raw", $file) or die; local $/; my $d = <$f>; close $f;
    my $n = unpack("Q<", substr($d, 0, 8)); my $h = substr($d, 8, $n); my $rest = substr($d, 8 + $n);
    $_ = $h; eval $expr; die $@ if $@; $h = $_;
    open($f, ">:raw", $file) or die; print $f pack("Q<", length $h), $h, $rest; close $f;' "$1" "$2"
}

Q=qwen3_moe; M=mixtral
prompt=(--tokens 1,2,3 -n 2)

expect missing-dir "/nonexistent/model" -- --model /nonexistent/model "${prompt[@]}"
copy $Q; rm "$tmp/m/config.json"
expect missing-config "config.json" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; echo '{"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": ' >"$tmp/m/config.json"
expect config-not-json "config.json" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; sed -i 's/Qwen3MoeForCausalLM/LlamaForCausalLM/' "$tmp/m/config.json"
expect unknown-arch "config.json" "LlamaForCausalLM" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; sed -i 's/"rope_scaling": null/"rope_scaling": {"type": "longrope", "factor": 4.0}/' "$tmp/m/config.json"
grep -q '"rope_scaling": {' "$tmp/m/config.json" || sed -i 's/^{/{"rope_scaling": {"type": "longrope", "factor": 4.0},/' "$tmp/m/config.json"
expect rope-scaling "config.json" "rope_scaling" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; sed -i 's/"hidden_act": "silu"/"hidden_act": "gelu"/' "$tmp/m/config.json"
expect bad-activation "config.json" "hidden_act" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; sed -i 's/"num_hidden_layers": [0-9]*/"num_hidden_layers": -1/' "$tmp/m/config.json"
expect negative-layers "config.json" "num_hidden_layers" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; sed -i '/"hidden_size"/d' "$tmp/m/config.json"
expect missing-field "config.json" "hidden_size" -- --model "$tmp/m" "${prompt[@]}"

# Tensors that disagree with config.json.
copy $Q; sed -i 's/"moe_intermediate_size": [0-9]*/"moe_intermediate_size": 50/' "$tmp/m/config.json"
expect shape-vs-config "model.safetensors" "config.json" -- --model "$tmp/m" "${prompt[@]}"
copy $M; sed -i 's/"num_hidden_layers": [0-9]*/"num_hidden_layers": 3/' "$tmp/m/config.json"
expect missing-tensor "model.layers.2." "not found" -- --model "$tmp/m" "${prompt[@]}"

# DeepSeek-V3: a latent size that disagrees with the tensors, a missing
# latent-attention tensor, a routing variant and a rope type it does not
# implement.
D=deepseek_v3
copy $D; sed -i 's/"kv_lora_rank": 32/"kv_lora_rank": 48/' "$tmp/m/config.json"
expect dsv3-kv-lora-vs-tensors "kv_a_proj_with_mqa" "config.json implies" -- --model "$tmp/m" "${prompt[@]}"
copy $D; st_edit "$tmp/m/model.safetensors" 's/layers\.1\.self_attn\.kv_b_proj/layers.1.self_attn.kv_x_proj/'
expect dsv3-missing-kv-b "model.layers.1.self_attn.kv_b_proj.weight" "not found" -- --model "$tmp/m" "${prompt[@]}"
copy $D; sed -i 's/^{/{"topk_method": "group_limited_greedy",/' "$tmp/m/config.json"
expect dsv3-topk-method "config.json" "topk_method" -- --model "$tmp/m" "${prompt[@]}"
copy $D; sed -i 's/"rope_type": "yarn"/"rope_type": "dynamic"/' "$tmp/m/config.json"
expect dsv3-rope-type "config.json" "rope_parameters" -- --model "$tmp/m" "${prompt[@]}"

# Damaged safetensors files.
copy $Q; truncate -s 4 "$tmp/m/model.safetensors"
expect st-tiny "model.safetensors" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; truncate -s $(( $(stat -c %s "$tmp/m/model.safetensors") / 2 )) "$tmp/m/model.safetensors"
expect st-truncated "model.safetensors" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; printf '\xff\xff\xff\xff\x00\x00\x00\x00' | dd of="$tmp/m/model.safetensors" conv=notrunc status=none
expect st-header-beyond-file "model.safetensors" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; st_edit "$tmp/m/model.safetensors" 's/"data_offsets":\[(\d+),(\d+)\]/"data_offsets":[$1,99999999999]/'
expect st-offset-out-of-range "model.safetensors" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; st_edit "$tmp/m/model.safetensors" 's/"dtype":"F32"/"dtype":"F16"/'
expect st-dtype-vs-shape "model.safetensors" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; st_edit "$tmp/m/model.safetensors" 's/"dtype":"F32"/"dtype":"Q4"/'
expect st-bad-dtype "model.safetensors" -- --model "$tmp/m" "${prompt[@]}"
copy $Q; st_edit "$tmp/m/model.safetensors" 's/^\{/{ oops /'
expect st-header-not-json "model.safetensors" -- --model "$tmp/m" "${prompt[@]}"
copy $M; rm "$tmp/m/$(ls "$tmp/m" | grep -m1 'of-')"
expect shard-missing "safetensors" -- --model "$tmp/m" "${prompt[@]}"

# Bad tokenizer.json (used by --prompt), bad command-line values.
copy $Q; echo '{"model": {"type": "BPE", "vocab": ' >"$tmp/m/tokenizer.json"
expect tokenizer-not-json "tokenizer.json" -- --model "$tmp/m" --prompt "hello" -n 2
copy $Q; sed -i 's/"type": *"BPE"/"type": "WordPiece"/' "$tmp/m/tokenizer.json"
expect tokenizer-unsupported "tokenizer.json" "WordPiece" -- --model "$tmp/m" --prompt "hello" -n 2
expect token-out-of-range "--tokens" "999999" -- --model "$fixtures/$Q" --tokens 1,999999
expect bad-dtype-flag "--dtype" -- --model "$fixtures/$Q" --tokens 1 --dtype fp8
expect bad-top-p "--top-p" -- --model "$fixtures/$Q" --tokens 1 --top-p 1.5
expect bad-spec-tokens "--spec-tokens" "17" -- --model "$fixtures/$Q" --tokens 1 --spec-tokens 17
expect bad-spec-policy "--spec-policy" "greedy" -- --model "$fixtures/$Q" --tokens 1 --spec-tokens 2 --spec-policy greedy
expect engine-flag-one-prompt "--kv-memory" "--prompts-file" -- --model "$fixtures/$Q" --tokens 1 --kv-memory 64
expect draft-one-prompt "--draft-model" "--prompts-file" -- --model "$fixtures/$Q" --prompt hi --draft-model "$fixtures/$Q"
expect too-long "max_position_embeddings" -- --model "$fixtures/$Q" --tokens 1 -n 100000
MOE_BATCH_INVARIANT=yes expect bad-batch-invariant-env "MOE_BATCH_INVARIANT" "yes" -- --model "$fixtures/$Q" --tokens 1
expect no-gpu-cuda "cuda" -- --model "$fixtures/$Q" --tokens 1 --device cuda
expect bad-device "tpu" -- --model "$fixtures/$Q" --tokens 1 --device tpu

# The group's flags, on both programs that take them: refused by name before
# anything loads, and a start-up that fails before the model (no mpirun for
# --tp, no such device) ends cleanly (moe-worker crashed there once, freeing a
# KV cache it never made).
for prog in moe-generate moe-worker; do
  if [ ! -x "$bindir/$prog" ]; then
    echo "skipped $prog launch flags: $prog was not built (-DMOE_SERVING=OFF)"
    continue
  fi
  bin=$bindir/$prog
  one=(); [ $prog = moe-generate ] && one=(--tokens 1)
  m=(--model "$fixtures/$Q" "${one[@]}")
  expect "$prog kv-dtype" "--kv-dtype" "fp8" -- "${m[@]}" --kv-dtype fp8
  expect "$prog dtype" "--dtype" "fp8" -- "${m[@]}" --dtype fp8
  expect "$prog group-size" "--group-size" "48" -- "${m[@]}" --dtype int4 --group-size 48
  expect "$prog group-size-without-int4" "--group-size goes with --dtype int4" -- "${m[@]}" --group-size 64
  expect "$prog tp-0" "--tp" "'0'" -- "${m[@]}" --tp 0
  expect "$prog spec-policy" "--spec-policy" "greedy" -- "${m[@]}" --spec-policy greedy
  expect "$prog kv-memory-0" "--kv-memory" "'0'" -- "${m[@]}" --kv-memory 0
  expect "$prog comm-timeout" "--comm-timeout-ms" "'50'" -- "${m[@]}" --comm-timeout-ms 50
  expect "$prog threads-no-value" "--threads" "needs a value" -- "${m[@]}" --threads
  expect "$prog no-model" "--model DIR is required" -- "${one[@]}" --exact
  expect "$prog tp-without-mpirun" "--tp" "mpirun" -- "${m[@]}" --tp 2
  expect "$prog placement-without-mpirun" "--placement" "mpirun" -- "${m[@]}" --placement /nonexistent.json
  expect "$prog bad-device" "tpu" -- "${m[@]}" --device tpu
done

# The servers' addresses: a port past 65535 is refused by name (gRPC itself
# took 127.0.0.1:99999 and listened on 99999 mod 65536).
if [ -x "$bindir/moe-worker" ] && [ -x "$bindir/moe-coordinator" ]; then
  bin=$bindir/moe-worker
  expect "moe-worker listen-port" "--listen" "99999" -- --model "$fixtures/$Q" --listen 127.0.0.1:99999
  expect "moe-worker advertise" "--advertise" "nohost" -- --model "$fixtures/$Q" --advertise nohost
  expect "moe-worker kv-listen" "--kv-listen" "70000" -- --model "$fixtures/$Q" --kv-listen :70000
  bin=$bindir/moe-coordinator
  expect "moe-coordinator listen-port" "--listen" "99999" -- --model "$fixtures/$Q" --workers 127.0.0.1:1 --listen 127.0.0.1:99999
  expect "moe-coordinator http-listen" "--http-listen" "1.2.3.4" -- --model "$fixtures/$Q" --workers 127.0.0.1:1 --http-listen 1.2.3.4
else
  echo "skipped server addresses: moe-worker and moe-coordinator were not built (-DMOE_SERVING=OFF)"
fi

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
