// `netdam-bench allreduce|reducescatter|allgather|broadcast`: the
// collectives benchmark (nccl-tests conventions; collectives_bench.cc).
#pragma once

namespace netdam::bench {

// argv[1] is the collective's name.
int collectives_main(int argc, char** argv);

}  // namespace netdam::bench
