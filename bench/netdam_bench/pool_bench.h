// `netdam-bench pool`: READ/WRITE through the pool proxy and straight to the
// devices, against Redis GET/SET of the same sizes in the same run
// (pool_bench.cc; docs/BENCHMARKS.md).
#pragma once

namespace netdam::bench {

// argv[1] is "pool".
int pool_main(int argc, char** argv);

}  // namespace netdam::bench
