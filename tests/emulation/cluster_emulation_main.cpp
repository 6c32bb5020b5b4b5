// Runs `kernels/cluster_row_stats.cu` (KERNEL_SOURCE) on the CPU over rows of logits read from files, a
// cluster of CLUSTER blocks of THREADS threads per row, every thread a CPU thread (`cluster_emulation.h`).
//
//   emulator DIR ROWS COLS STRIDE_BYTES PICKS T_BITS HI_BITS LO_BITS DIVISION STRIDE_FULL WIDTH HAS_LABELS WANT_FULL
//
// reads DIR/x.bin (ROWS rows of STRIDE_BYTES bytes) and, with HAS_LABELS, DIR/labels.bin (int64, ROWS x
// PICKS); T_BITS is the temperature's fp32 bit pattern, HI_BITS, LO_BITS and DIVISION the host's set-up
// of its division (`kernels/division_setup.py`: t_hi's and t_lo's fp32 bit patterns, t_division). Writes
// DIR/{max,log_sum,lse}.bin (fp32 [ROWS]), logp.bin (fp32 [ROWS, PICKS]) with labels, ent.bin with
// ENTROPY, full.bin (fp32, ROWS x STRIDE_FULL) with WANT_FULL: what the launch in `cluster_launch.py` asks
// of the kernel. Outputs start as a NaN pattern the kernel never writes, and shared memory as 0xA5 bytes;
// every buffer has exactly its size.
#include "cluster_emulation.h"

#include KERNEL_SOURCE

#include <pthread.h>

#include <fstream>
#include <new>
#include <string>
#include <vector>

namespace {

struct Launch {
  const unsigned char* x;
  long long stride_bytes;
  const long long* labels;
  int picks;
  float t, t_hi, t_lo;
  int t_division;
  float *out_max, *out_log_sum, *out_lse, *out_logp, *out_ent, *out_full;
  long long stride_full;
  int cols, width, row;
  emu::Cluster* cluster;
};

struct Start {
  const Launch* launch;
  unsigned rank, tid;
};

void* run_thread(void* p) {
  const Start& s = *static_cast<Start*>(p);
  const Launch& l = *s.launch;
  emu::self.block = &l.cluster->blocks[s.rank];
  emu::self.cluster = l.cluster;
  emu::self.rank = s.rank;
  emu::self.arrival.reset();
  threadIdx.x = s.tid;
  blockIdx.x = (unsigned)l.row * CLUSTER + s.rank;
  cluster_row_stats(l.x, l.stride_bytes, l.labels, l.picks, l.t, l.t_hi, l.t_lo, l.t_division, l.out_max,
                    l.out_log_sum, l.out_lse, l.out_logp, l.out_ent, l.out_full, l.stride_full, l.cols, l.width);
  if (emu::self.arrival) emu::fail("a thread ended with a cluster arrival it never waited on");
  return nullptr;
}

std::barrier<>* barriers(int count, std::ptrdiff_t expected) {
  auto* raw = static_cast<std::barrier<>*>(::operator new(sizeof(std::barrier<>) * count));
  for (int i = 0; i < count; ++i) new (raw + i) std::barrier<>(expected);
  return raw;
}

void free_barriers(std::barrier<>* b, int count) {
  for (int i = 0; i < count; ++i) b[i].~barrier();
  ::operator delete(b);
}

// `bytes` exactly (an AddressSanitizer build reports any access past them), 128-byte aligned.
void* aligned(std::size_t bytes, unsigned char fill) {
  void* p = nullptr;
  if (posix_memalign(&p, 128, bytes ? bytes : 1) != 0) emu::fail("posix_memalign");
  std::memset(p, fill, bytes);
  return p;
}

void* read_file(const std::string& path, std::size_t bytes) {
  void* p = aligned(bytes, 0);
  std::ifstream in(path, std::ios::binary);
  if (!in.read(static_cast<char*>(p), (std::streamsize)bytes)) emu::fail("a short input file");
  return p;
}

void write_file(const std::string& path, const void* p, std::size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(p), (std::streamsize)bytes);
}

float* output(std::size_t count) {
  auto* p = static_cast<float*>(aligned(count * 4, 0));
  for (std::size_t i = 0; i < count; ++i) p[i] = __uint_as_float(0x7fbadbadu);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 14) {
    emu::fail("usage: emulator DIR ROWS COLS STRIDE_BYTES PICKS T_BITS HI_BITS LO_BITS DIVISION STRIDE_FULL WIDTH "
              "HAS_LABELS WANT_FULL");
  }
  const std::string dir = argv[1];
  const int rows = std::atoi(argv[2]), cols = std::atoi(argv[3]);
  const long long stride_bytes = std::atoll(argv[4]);
  const int picks = std::atoi(argv[5]);
  const float t = __uint_as_float((unsigned)std::strtoul(argv[6], nullptr, 10));
  const float t_hi = __uint_as_float((unsigned)std::strtoul(argv[7], nullptr, 10));
  const float t_lo = __uint_as_float((unsigned)std::strtoul(argv[8], nullptr, 10));
  const int t_division = std::atoi(argv[9]);
  const long long stride_full = std::atoll(argv[10]);
  const int width = std::atoi(argv[11]);
  const bool has_labels = std::atoi(argv[12]) != 0, want_full = std::atoi(argv[13]) != 0;

  Launch l{};
  l.x = static_cast<const unsigned char*>(read_file(dir + "/x.bin", (std::size_t)rows * stride_bytes));
  l.stride_bytes = stride_bytes;
  l.labels = has_labels ? static_cast<const long long*>(read_file(dir + "/labels.bin", (std::size_t)rows * picks * 8)) : nullptr;
  l.picks = picks;
  l.t = t;
  l.t_hi = t_hi;
  l.t_lo = t_lo;
  l.t_division = t_division;
  l.out_max = output(rows);
  l.out_log_sum = output(rows);
  l.out_lse = output(rows);
  l.out_logp = has_labels ? output((std::size_t)rows * picks) : nullptr;
  l.out_ent = ENTROPY ? output(rows) : nullptr;
  l.out_full = want_full ? output((std::size_t)rows * stride_full) : nullptr;
  l.stride_full = stride_full;
  l.cols = cols;
  l.width = width;

  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 1 << 18);
  for (int row = 0; row < rows; ++row) {
    std::barrier<>* cluster_barrier = barriers(1, CLUSTER * THREADS);
    std::vector<emu::Block> blocks(CLUSTER);
    for (auto& b : blocks) {
      b.threads = barriers(1, THREADS);
      b.warps = barriers(WARPS, 32);
      b.arena_bytes = sizeof(BlockShared);
      b.arena = static_cast<unsigned char*>(aligned(sizeof(BlockShared), 0xA5));
      b.dynamic = static_cast<unsigned char*>(aligned((std::size_t)width * ESIZE, 0xA5));
      b.exchange = static_cast<std::uint64_t*>(aligned(THREADS * 8, 0));
    }
    emu::Cluster cluster{cluster_barrier, blocks.data(), CLUSTER};
    l.row = row;
    l.cluster = &cluster;
    std::vector<Start> starts;
    starts.reserve(CLUSTER * THREADS);
    std::vector<pthread_t> threads(CLUSTER * THREADS);
    for (unsigned rank = 0; rank < CLUSTER; ++rank)
      for (unsigned tid = 0; tid < THREADS; ++tid) starts.push_back({&l, rank, tid});
    for (std::size_t i = 0; i < starts.size(); ++i)
      if (pthread_create(&threads[i], &attr, run_thread, &starts[i]) != 0) emu::fail("pthread_create");
    for (auto& th : threads) pthread_join(th, nullptr);
    for (auto& b : blocks) {
      free_barriers(b.threads, 1);
      free_barriers(b.warps, WARPS);
      std::free(b.arena);
      std::free(b.dynamic);
      std::free(b.exchange);
    }
    free_barriers(cluster_barrier, 1);
  }
  write_file(dir + "/max.bin", l.out_max, rows * 4);
  write_file(dir + "/log_sum.bin", l.out_log_sum, rows * 4);
  write_file(dir + "/lse.bin", l.out_lse, rows * 4);
  if (has_labels) write_file(dir + "/logp.bin", l.out_logp, (std::size_t)rows * picks * 4);
  if (ENTROPY) write_file(dir + "/ent.bin", l.out_ent, rows * 4);
  if (want_full) write_file(dir + "/full.bin", l.out_full, (std::size_t)rows * stride_full * 4);
  for (const void* p : {(const void*)l.x, (const void*)l.labels, (const void*)l.out_max, (const void*)l.out_log_sum,
                        (const void*)l.out_lse, (const void*)l.out_logp, (const void*)l.out_ent, (const void*)l.out_full})
    std::free(const_cast<void*>(p));
  pthread_attr_destroy(&attr);
  return 0;
}
