# Why a ValueError from the extension kills the process on the AMX host: one process per case and setting
{
echo "glibc: $(ldd --version | head -1)"; echo "g++: $(g++ --version | head -1) / $(/usr/bin/g++ --version 2>&1 | head -1)"
ldd bertfast/_C*.so | grep -E "stdc|gcc_s|gomp|libc\.so"
python3 -c "import torch; from bertfast import _C; print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l or 'libgcc_s' in l}))"
} > "$1/diag.txt" 2>&1
T1="'tests/ops/cpu/test_ops.py::test_errors_raise_value_error[attention-shape]'"
T2="'tests/ops/cpu/test_ops.py::test_errors_raise_value_error[attention-k-dtype-mismatch]'"
T3="tests/test_amx_gemm.py::test_set_amx_blocking_refuses_a_bad_geometry"
T4="'tests/ops/cpu/test_ops.py::test_errors_raise_value_error[embed-id-range]'"
n=$(nproc); i=$(( n > 2 ? 2 : 0 ))
T5="tests/ops/cpu/test_ops.py -k 'amx or errors'"
for t in "$T1" "$T2" "$T3" "$T4" "$T5"; do
  for env in "X=1" "BERTFAST_ISA=avx512_vnni" "LD_BIND_NOW=1"; do
    ( env $env taskset -c $i timeout 90 sh -c "python3 -m pytest -q -p no:cacheprovider $t" > "$1/d-$i.log" 2>&1
      echo "$env $t rc=$? $(grep -c 'Segmentation' "$1/d-$i.log")segv" ) >> "$1/diag.txt" &
    i=$(( i + 1 )); [ $i -ge $n ] && i=$(( n > 2 ? 2 : 0 ))
  done
done
wait; tail -n 3 "$1"/d-*.log >> "$1/diag.txt"; rm -f "$1"/d-*.log
