// Run-time choice of the int8 kernel variant, and block_linear_int8 / quant_linear_int8 on it.
//
// Variants, best first: avx512vnni, amx, avx512, avxvnni, avx2 (each built only if the compiler
// accepted its flags: build.py defines SPARKSERVE_HAS_<VARIANT>). amx ranks below avx512vnni, which
// every AMX CPU also has, because it measured slower there (docs/kernel-notes.md): it runs when
// avx512vnni is switched off. The first one the CPU supports and that
// SPARKSERVE_KERNEL_VARIANTS_OFF (comma-separated names) does not switch off runs; with all of
// them off the int8 entry points compute with fp32 activations (block_linear). Every variant reads
// the packed copy of the weights (int8_common.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "block_linear.h"
#include "int8_common.h"
#include "int8_packed.h"
#include "thread_pool.h"

namespace {

using sparkserve::int8::PackedRowsFn;

struct Variant {
  const char* name;
  PackedRowsFn packed;    // nullptr: fp32 activations
};

bool switched_off(const char* name) {
  const char* env = std::getenv("SPARKSERVE_KERNEL_VARIANTS_OFF");
  if (env == nullptr) return false;
  std::stringstream ss(env);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item == name) return true;
  }
  return false;
}

// Linux hands a process the AMX tile state (XTILEDATA, 8 KiB per thread) only on request; the
// grant is process-wide and passes to forked children.
bool amx_granted() {
#ifdef __linux__
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
#else
  return false;
#endif
}

bool cpu_has(const std::string& name) {
  __builtin_cpu_init();
  if (name == "amx")
    return cpu_has("avx512vnni") && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
           amx_granted();
  if (name == "amx_emulated") return cpu_has("avx512vnni");   // its scales and one-row path are VNNI
  if (name == "avxvnni_evex") return cpu_has("avx512vnni");
  if (name == "avx512vnni")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  if (name == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  if (name == "avxvnni") return __builtin_cpu_supports("avxvnni");
  return name == "avx2" && __builtin_cpu_supports("avx2");
}

// The variants built into this extension, best first.
const std::vector<Variant>& built() {
  static const std::vector<Variant> v = {
#ifdef SPARKSERVE_HAS_AVX512VNNI
      {"avx512vnni", sparkserve::int8::rows_avx512vnni_packed},
#endif
#ifdef SPARKSERVE_HAS_AMX
      {"amx", sparkserve::int8::rows_amx_packed},
#endif
#ifdef SPARKSERVE_HAS_AVX512
      {"avx512", sparkserve::int8::rows_avx512_packed},
#endif
#ifdef SPARKSERVE_HAS_AVXVNNI
      {"avxvnni", sparkserve::int8::rows_avxvnni_packed},
#endif
      {"avx2", sparkserve::int8::rows_avx2_packed},
  };
  return v;
}

// Variants that tests name and the dispatcher never picks.
const std::vector<Variant>& test_only_variants() {
  static const std::vector<Variant> v = {
#ifdef SPARKSERVE_HAS_AMX_EMULATED
      {"amx_emulated", sparkserve::int8::rows_amx_emulated_packed},
#endif
#ifdef SPARKSERVE_HAS_AVXVNNI_EVEX
      {"avxvnni_evex", sparkserve::int8::rows_avxvnni_evex_packed},
#endif
  };
  return v;
}

Variant choose() {
  for (const Variant& v : built())
    if (cpu_has(v.name) && !switched_off(v.name)) return v;
  return {"fp32", nullptr};
}

const Variant& variant() {
  static const Variant v = choose();   // the environment is read once, at first use
  return v;
}

}  // namespace

namespace sparkserve {

const char* int8_variant() { return variant().name; }

bool isa_usable(const char* name) { return cpu_has(name) && !switched_off(name); }

namespace {

void linear_int8_on(const Variant& v, const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N,
                    int qtype, const float* bias, float* y) {
  const bool in_place = int8::is_packed_type(qtype);    // packed already: no copy to look up
  qtype = int8::gguf_type_of(qtype);
  if (!int8::int8_reads(qtype) || v.packed == nullptr) {
    TORCH_CHECK(!in_place, "int8 linear: packed blocks need an int8 kernel variant, and none runs");
    block_linear(x, M, K, w.data_ptr<uint8_t>(), N, qtype, bias, y);
    return;
  }
  if (M == 0 || N == 0) return;
  std::vector<int8_t> qs(M * K);
  const int64_t ns = int8::quantx_scales(M, K);
  std::vector<float> scales(2 * ns);       // d, s
  std::vector<int32_t> sums(3 * ns);       // xn, ha, hb
  float* d = scales.data();
  int32_t* xs = sums.data();
  const int8::QuantX q{qs.data(), d, d + ns, xs, xs + ns, xs + 2 * ns, M, K};
  const int64_t tiles = (M + int8::kTile - 1) / int8::kTile;
  // Quantizing x is cheap next to the product: threads only from a few tiles of wide rows on.
  const int64_t qgrain = std::max<int64_t>(1, (64 << 10) / (int8::kTile * K));
  sparkserve::parallel_for(0, tiles, qgrain, [&](int64_t t0, int64_t t1) {
    int8::quantize_rows(x, t0 * int8::kTile, std::min(M, t1 * int8::kTile), q);
  });
  const int64_t row_bytes = K / 32 * block_bytes_of(qtype);
  const int64_t grain = std::max<int64_t>(16, (32 << 10) / row_bytes);   // >= ~32 KiB of weights per task
  const uint8_t* wp = in_place ? w.data_ptr<uint8_t>() : int8::packed_weights(w, N, K, qtype);
  const int64_t groups = (N + int8::kGroupRows - 1) / int8::kGroupRows, G = int8::kGroupRows;
  sparkserve::parallel_for(0, groups, (grain + G - 1) / G, [&](int64_t g0, int64_t g1) {   // at group edges
    v.packed(q, wp, qtype, g0 * G, std::min(N, g1 * G), bias, y, N);
  });
}

}  // namespace

void block_linear_int8(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N, int qtype,
                       const float* bias, float* y) {
  linear_int8_on(variant(), x, M, K, w, N, qtype, bias, y);
}

}  // namespace sparkserve

// As quant_linear (quant_gemv.cpp), with x quantized to int8 per block of 32 for the types int8_reads.
at::Tensor quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, std::optional<at::Tensor> bias);

// `variant`: "" for the dispatcher's choice, or a variant by name, the test-only ones included (tests;
// it must run on this CPU).
at::Tensor quant_linear_int8(at::Tensor x, at::Tensor w, int64_t qtype, std::optional<at::Tensor> bias,
                             const std::string& variant_name) {
  Variant v = variant();
  if (!variant_name.empty()) {
    v = {"fp32", nullptr};
    for (const auto* list : {&built(), &test_only_variants()})
      for (const Variant& b : *list)
        if (variant_name == b.name) v = b;
    const bool found = v.packed != nullptr;
    TORCH_CHECK(found || variant_name == "fp32", "quant_linear_int8: variant ", variant_name, " is not built");
    TORCH_CHECK(!found || cpu_has(variant_name), "quant_linear_int8: this CPU cannot run ", variant_name);
  }
  const int gguf = sparkserve::int8::gguf_type_of(static_cast<int>(qtype));
  TORCH_CHECK(v.packed != nullptr || !sparkserve::int8::is_packed_type(static_cast<int>(qtype)),
              "quant_linear_int8: packed blocks need an int8 kernel variant, and ", v.name, " is none");
  if (!sparkserve::int8::int8_reads(gguf) || v.packed == nullptr) return quant_linear(x, w, qtype, bias);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quant_linear_int8: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_linear_int8: w must be a contiguous 2-D uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0, "quant_linear_int8: K must be a multiple of 32, got ", K);
  TORCH_CHECK(w.size(1) == K / 32 * sparkserve::block_bytes_of(static_cast<int>(qtype)),
              "quant_linear_int8: w has ", w.size(1), " bytes per row for K = ", K);
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "quant_linear_int8: bad bias");
    bp = b.data_ptr<float>();
  }
  x = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  sparkserve::linear_int8_on(v, x.data_ptr<float>(), M, K, w, N, static_cast<int>(qtype), bp, y.data_ptr<float>());
  return y;
}

std::string int8_variant_name() { return sparkserve::int8_variant(); }

// Variants built here that this CPU runs, best first (whatever SPARKSERVE_KERNEL_VARIANTS_OFF says);
// test_only: the ones only tests name.
std::vector<std::string> int8_variants_runnable(bool test_only) {
  std::vector<std::string> out;
  for (const Variant& v : test_only ? test_only_variants() : built())
    if (cpu_has(v.name)) out.push_back(v.name);
  return out;
}

int64_t int8_packed_weights_held() { return sparkserve::int8::packed_weights_held(); }
