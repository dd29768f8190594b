// moonep-bench-gemm-cuda: the same benchmark as `moonep-bench-gemm --device cuda`.
int RunCudaGemmBench(int argc, char** argv);

int main(int argc, char** argv) { return RunCudaGemmBench(argc, argv); }
