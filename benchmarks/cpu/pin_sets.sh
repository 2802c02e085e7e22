#!/usr/bin/env bash
# Weight sha256s of the train stage under candidate CPU pin sets, to compare hosts (issue 31):
# a pin set that gives the same digits on two hosts with different CPUs or caches is a
# candidate for a faster portable profile; one that differs is not. Trains 3 epochs with no
# DataLoader workers per pin set, in fresh processes; prints the CPU's caches, then one line
# per pin set with the first 16 hex digits of sha256_state_dict of the weights, under the
# digits network's own tensor names (the module's "net." prefix dropped, as the weights
# files named them before issue 29), so rows compare with earlier tables. It stays on the digits
# recipe, where the other benchmarks train the language model: the cross-host table is in digits
# weights. Then the same for the language model (one epoch, its own params), the rows "lm ...":
# its cost under portable is MKL's GEMM (benchmarks/cpu/cpu_pins.py --workload lm), so its rows put
# MKL's Intel-only AVX2 branch (MKL_CBWR=AVX2,STRICT) beside COMPATIBLE, with MKL's dispatch
# also capped at AVX2 (MKL_ENABLE_INSTRUCTIONS, an older Intel CPU emulated; the cap alone, with
# no branch, is the control that it reaches MKL); "lm-portable" is the recipe's own params
# (portable: the project's kernels, no MKL in a step). Run from the
# repository root after `make venv`:
#     bash benchmarks/cpu/pin_sets.sh
# (The same rows as ../shared/tools/pin-fingerprints.sh, whose table the docs extend.)
set -euo pipefail
root=$(pwd)
export PATH="$root/.venv/bin:$PATH"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp params.yaml "$work/"
sed 's/profile: portable/profile: native/' pipelines/lm/params.yaml >"$work/lm-params.yaml"
cp pipelines/lm/params.yaml "$work/lm-portable-params.yaml"
cd "$work"
sed 's/profile: portable/profile: native/' params.yaml >params-native.yaml
cp params.yaml params-portable.yaml
mkdir raw
reprotrain prepare --raw-dir raw --out d.safetensors >/dev/null
run() {
	local name=$1 profile=$2
	shift 2
	mkdir -p "$name"
	env "$@" reprotrain env --lock "$root/requirements-cpu.lock" --out "$name/env.json" \
		--params "params-$profile.yaml" >/dev/null
	env "$@" reprotrain train --data d.safetensors --env "$name/env.json" \
		--model "$name/m.safetensors" --metrics "$name/met.json" --plots "$name/plots" \
		--run-record "$name/run.json" --checkpoints "$name/ck" -S train.max_epochs=3 \
		-S data.init_args.num_workers=0 -S data.init_args.path=d.safetensors \
		-S "cpu.profile=$profile" >"$name/log" 2>&1 ||
		{ echo "$name failed: $(tail -n1 "$name/log")"; return; }
	fingerprint "$name"
}
fingerprint() {
	printf '%-40s %s\n' "$1" "$(python -c "from reprotrain.hashing import sha256_state_dict as f, load_safetensors as l; w = l('$1/m.safetensors')[0]; print(f({k.removeprefix('net.'): v for k, v in w.items()})[:16])")"
}
run_lm() { # name, then variables; LM_PARAMS: another params file (default: native)
	local name=$1 params=${LM_PARAMS:-lm-params.yaml}
	shift
	mkdir -p "$name"
	env "$@" reprotrain env --lock "$root/requirements-cpu.lock" --out "$name/env.json" \
		--params "$params" >/dev/null
	env "$@" reprotrain train --params "$params" --env "$name/env.json" \
		--model "$name/m.safetensors" --metrics "$name/met.json" --plots "$name/plots" \
		--run-record "$name/run.json" --checkpoints "$name/ck" -S train.max_epochs=1 \
		>"$name/log" 2>&1 ||
		{ echo "$name failed: $(tail -n1 "$name/log")"; return; }
	fingerprint "$name"
}
grep -m1 "model name" /proc/cpuinfo
lscpu | grep -E "L1d|L2|L3"
grep -o -m1 -w "avx512f" /proc/cpuinfo || echo "no avx512f"
run portable portable X=1
run native native X=1
run native-aten-avx2 native ATEN_CPU_CAPABILITY=avx2
run native-aten-avx2-onednn-avx2 native ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
run native-aten-avx2-onednn-avx2-mklcompat native ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	MKL_CBWR=COMPATIBLE,STRICT
run native-onednn-sse41-mklcompat native ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=SSE41 \
	MKL_CBWR=COMPATIBLE,STRICT
LM_PARAMS=lm-portable-params.yaml run_lm lm-portable X=1
run_lm lm-native X=1
run_lm lm-aten-avx2 ATEN_CPU_CAPABILITY=avx2
run_lm lm-aten-avx2-mkl-capped ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
run_lm lm-aten-avx2-mklcompat ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE,STRICT
run_lm lm-aten-avx2-mklavx2 ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2,STRICT
run_lm lm-aten-avx2-mklavx2-mkl-capped ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2,STRICT \
	MKL_ENABLE_INSTRUCTIONS=AVX2
