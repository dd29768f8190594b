export LD_LIBRARY_PATH=$PWD/.device/lib
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $OUT/smi.csv 2>&1 &
S=$!
sleep 1
for s in 1 4 3 0; do .device/bin/moonep-gemm-probe --only $s --sustain 2000; done > $OUT/sustain.log 2>&1
nvidia-smi -q -d PERFORMANCE > $OUT/perf.txt 2>&1
kill $S
cat $OUT/sustain.log; wc -l $OUT/smi.csv; head -3 $OUT/smi.csv
