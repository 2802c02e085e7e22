#!/usr/bin/env bash
# The check docs/cpu-profile.md owes a host of the other CPU vendor (issue 43, item 4),
# in one command. Run from the repository root after `make venv`:
#     bash benchmarks/vendor_check.sh [REFERENCE_FOLDER]   (default docs/cpu/intel-xeon)
# 1. kernels: benchmarks/kernel_bits.py's portable "all rows" digest against the one in
#    the folder's host.json (the routed kernels on fixed inputs, seconds);
# 2. training: this host's side of both recipes (benchmarks/vendor_side.sh) against the
#    folder's: traces by `reprotrain compare`, step-0 op recordings by `reprotrain opdiff`;
# 3. reference: `make check-reference` (the committed dvc.lock and reports/ rebuilt here).
# One line per check, then the tools' own output for any that differ; exit 0 only when
# every check gave the same bits. Where the reference differs, its verdict names the
# deciding fields: on the other vendor, cpu.vendor alone is what the docs expect, and
# then cpu.vendor can leave the deciding record (docs/cpu-profile.md says how).
set -euo pipefail
ref=${1:-docs/cpu/intel-xeon}
[[ -f $ref/host.json ]] || {
	echo "vendor_check: $ref/host.json not found: name a folder benchmarks/vendor_side.sh wrote" >&2
	exit 2
}
bin=$(pwd)/.venv/bin
here=$(mktemp -d)
trap 'rm -rf "$here"' EXIT
failed=0
say() { # check, verdict, detail file
	printf '%-38s %s\n' "$1" "$2"
	[[ $2 == same* ]] || { failed=1; sed 's/^/    /' "$3"; }
}

want=$("$bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("kernel_bits_all_rows", ""))' "$ref/host.json")
"$bin/python" benchmarks/kernel_bits.py >"$here/kernels.txt"
got=$(awk '/^portable/ && /all rows/ {print $NF}' "$here/kernels.txt")
if [[ -z $want ]]; then
	echo "no kernel digest in $ref/host.json (rerun vendor_side.sh there)" >"$here/kernels.why"
	say "kernels (kernel_bits all rows)" "not compared" "$here/kernels.why"
elif [[ $got == "$want" ]]; then
	say "kernels (kernel_bits all rows)" "same bits ($got)" /dev/null
else
	say "kernels (kernel_bits all rows)" "OTHER BITS ($got, $ref: $want)" "$here/kernels.txt"
fi

bash benchmarks/vendor_side.sh "$here/side" >/dev/null
for recipe in digits lm; do
	for file in "$recipe-trace.safetensors" "$recipe-step0-ops.safetensors"; do
		tool=compare
		[[ $file == *ops* ]] && tool=opdiff
		if "$bin/reprotrain" "$tool" "$here/side/$file" "$ref/$file" >"$here/$file.txt" 2>&1; then
			say "$recipe: $tool ${file#"$recipe"-}" "same bits" /dev/null
		else
			say "$recipe: $tool ${file#"$recipe"-}" "DIFFER (exit $?)" "$here/$file.txt"
		fi
	done
done

if make --no-print-directory check-reference >"$here/reference.txt" 2>&1; then
	say "reference (make check-reference)" "same bits: REPRODUCED" /dev/null
else
	say "reference (make check-reference)" "NOT REPRODUCED" "$here/reference.txt"
fi
exit $failed
