#!/usr/bin/env bash
# The check docs/cpu-profile.md owes a host of the other CPU vendor (issue 43, item 4),
# in one command. Run from the repository root after `make venv`:
#     bash benchmarks/cpu/vendor_check.sh [REFERENCE_FOLDER [OUT]]   (default docs/cpu/intel-xeon)
# 1. kernels: benchmarks/cpu/kernel_bits.py's portable "all rows" digest against the one in
#    the folder's host.json (the routed kernels on fixed inputs, seconds);
# 2. training: this host's side of both recipes (benchmarks/cpu/vendor_side.sh) against the
#    folder's: traces by `reprotrain compare`, step-0 op recordings by `reprotrain opdiff`;
# 3. reference: `reprotrain verify --reference HEAD` (what `make check-reference` runs:
#    the committed dvc.lock and reports/ rebuilt here, at HEAD, not the working tree).
# One line per check, then the tools' own output for any that differ; exit 0 only when
# every check gave the same bits. Under cpu.profile portable no fact of the host CPU is in
# the deciding record (its vendor neither), so a host of either vendor with the same bits
# says REPRODUCED (verify's exit 0). The same outputs under another deciding record
# (verify's exit 6: another Python minor, a lock not committed...) count as the same bits
# too, and that verdict, naming every pipeline's record files and the fields, is printed;
# verify's exit 1 is an output whose bits differ.
# This host's side (host.json with the CPU and the kernel digest, traces, op recordings)
# stays in OUT (default: a new folder, named at the end) for the table and for opdiff.
set -euo pipefail
ref=${1:-docs/cpu/intel-xeon}
[[ -f $ref/host.json ]] || {
	echo "vendor_check: $ref/host.json not found: name a folder benchmarks/cpu/vendor_side.sh wrote" >&2
	exit 2
}
bin=$(pwd)/.venv/bin
here=$(mktemp -d)
trap 'rm -rf "$here"' EXIT
side=${2:-$(mktemp -d)}
mkdir -p "$side"
[[ $(cd "$side" && pwd -P) != $(cd "$ref" && pwd -P) ]] || {
	echo "vendor_check: OUT is the reference folder $ref: name another" >&2
	exit 2
}
failed=0
say() { # check, verdict, detail file
	printf '%-38s %s\n' "$1" "$2"
	[[ $2 == same* ]] || { failed=1; sed 's/^/    /' "$3"; }
}

STEP=0 bash benchmarks/cpu/vendor_side.sh "$side" >/dev/null # also runs kernel_bits.py
digest() { # host.json -> its kernel digest, or nothing
	"$bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("kernel_bits_all_rows", ""))' "$1"
}
want=$(digest "$ref/host.json")
got=$(digest "$side/host.json")
if [[ -z $want ]]; then
	echo "no kernel digest in $ref/host.json (rerun vendor_side.sh there)" >"$here/kernels.why"
	say "kernels (kernel_bits all rows)" "not compared" "$here/kernels.why"
elif [[ $got == "$want" ]]; then
	say "kernels (kernel_bits all rows)" "same bits ($got)" /dev/null
else
	"$bin/python" benchmarks/cpu/kernel_bits.py >"$here/kernels.txt" # every row, to see which
	say "kernels (kernel_bits all rows)" "OTHER BITS ($got, $ref: $want)" "$here/kernels.txt"
fi

for recipe in digits lm; do
	for file in "$recipe-trace.safetensors" "$recipe-step0-ops.safetensors"; do
		tool=compare
		[[ $file == *ops* ]] && tool=opdiff
		if "$bin/reprotrain" "$tool" "$side/$file" "$ref/$file" >"$here/$file.txt" 2>&1; then
			say "$recipe: $tool ${file#"$recipe"-}" "same bits" /dev/null
		else
			say "$recipe: $tool ${file#"$recipe"-}" "DIFFER (exit $?)" "$here/$file.txt"
		fi
	done
done

status=0
"$bin/reprotrain" verify --reference HEAD >"$here/reference.txt" 2>&1 || status=$?
case $status in
0) say "reference (verify --reference HEAD)" "same bits: REPRODUCED" /dev/null ;;
6) # same outputs, another deciding record: the bits held; show which fields moved
	say "reference (verify --reference HEAD)" "same bits, another record (below)" /dev/null
	sed 's/^/    /' "$here/reference.txt"
	;;
*) say "reference (verify --reference HEAD)" "NOT REPRODUCED (exit $status)" "$here/reference.txt" ;;
esac
echo "this host's side: $side"
exit $failed
