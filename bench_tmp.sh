export PYTHONPATH=.
mkdir -p $OUT/b
cp benchmarks/results/decode.json $OUT/b/decode.json
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 380 python benchmarks/bench_decode.py --contexts 65536,131072 --skip-b --skip-dsv32 --modes sparse-gpu,sparse-hier,sparse-hier-ahead,sparse-hier-fp8,sparse-hier-fp8-ahead --section lookahead --time-budget 350 --out $OUT/b > $OUT/lookahead_log.txt 2>&1
timeout 80 python benchmarks/bench_decode.py --contexts 65536 --skip-b --skip-dsv32 --modes sparse-hier-ahead,sparse-hier-fp8-ahead --lookahead-pages 64 --section lookahead_m64 --time-budget 70 --out $OUT/b > $OUT/lookahead_m64_log.txt 2>&1
grep "tok/s" $OUT/lookahead_log.txt | tail -40
grep "tok/s" $OUT/lookahead_m64_log.txt
