export LD_LIBRARY_PATH=$PWD/.device/lib
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 20 > $OUT/smi.csv 2>&1 &
S=$!
sleep 1
for s in 0 1 4; do
  echo "## shape $s, a weight matrix per group"; .device/bin/moonep-gemm-probe --only $s --sustain 2000
  echo "## shape $s, --shared-weights"; .device/bin/moonep-gemm-probe --only $s --sustain 2000 --shared-weights
done > $OUT/sustain.log 2>&1
kill $S
cat $OUT/sustain.log
