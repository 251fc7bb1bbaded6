// Python bindings of the kernels (one extension module, built by build.py).
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "moe_experts.h"
#include "native_draft.h"
#include "native_llama.h"
#include "native_mla.h"

at::Tensor quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, std::optional<at::Tensor> bias);
at::Tensor quant_linear_int8(at::Tensor x, at::Tensor w, int64_t qtype, std::optional<at::Tensor> bias,
                             const std::string& variant);
std::string int8_variant_name();
std::vector<std::string> int8_variants_runnable(bool test_only);
int64_t int8_packed_weights_held();
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor r, at::Tensor w, double eps);
at::Tensor decode_attention(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_indices,
                            std::vector<int64_t> seq_lens, int64_t kv_start, int64_t window, double scale,
                            std::vector<int64_t> q_lens, const std::string& variant,
                            std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale,
                            std::optional<at::Tensor> sinks);
std::vector<std::string> decode_attention_variants();
at::Tensor prefill_attention(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_indices,
                             std::vector<int64_t> seq_lens, int64_t kv_start, int64_t window, double scale,
                             std::vector<int64_t> q_lens, const std::string& variant,
                             std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale);
std::string prefill_attention_variant();
std::vector<std::string> prefill_attention_variants();
bool prefill_attention_takes(int64_t H, int64_t Hkv, int64_t D);
at::Tensor markov_pack(at::Tensor w2);
at::Tensor argmax_rows(at::Tensor logits);
at::Tensor sample_rows(at::Tensor logits, const std::vector<int64_t>& rows, const std::vector<double>& temperature,
                       const std::vector<int64_t>& top_k, const std::vector<double>& top_p,
                       const std::vector<double>& min_p, const std::vector<double>& u);
std::tuple<at::Tensor, at::Tensor, at::Tensor> logprob_rows(at::Tensor logits, const std::vector<int64_t>& rows,
                                                            const std::vector<int64_t>& ids, int64_t k);
at::Tensor dequantize_rows(at::Tensor w, int64_t qtype, int64_t K, at::Tensor ids);
at::Tensor pack_blocks(at::Tensor w, int64_t qtype);
at::Tensor unpack_blocks(at::Tensor w, int64_t qtype);
std::tuple<at::Tensor, at::Tensor> markov_greedy(at::Tensor base, at::Tensor w1, at::Tensor w2p,
                                                 std::optional<at::Tensor> d2t, at::Tensor anchors);

// The linears as torch operators too (torch.ops.sparkserve.*), so a compiled graph calls them
// through the dispatcher without a trip into Python (benchmarks/compile.py).
TORCH_LIBRARY(sparkserve, m) {
  m.def("quant_linear(Tensor x, Tensor w, int qtype, Tensor? bias=None) -> Tensor");
  m.def("quant_linear_int8(Tensor x, Tensor w, int qtype, Tensor? bias=None, str variant='') -> Tensor");
}

TORCH_LIBRARY_IMPL(sparkserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_int8", [](at::Tensor x, at::Tensor w, int64_t qtype, std::optional<at::Tensor> bias,
                                 c10::string_view variant) {
    return quant_linear_int8(x, w, qtype, bias, std::string(variant));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x @ W.T with W in GGUF blocks (Q4_1, Q8_0, BF16)",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
  m.def("quant_linear_int8", &quant_linear_int8,
        "quant_linear with x quantized to int8 per block of 32 and integer dot products (Q4_1, Q8_0)",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none(), py::arg("variant") = "");
  m.def("dequantize_rows", &dequantize_rows, "rows ids of a block weight as fp32 (gguf-py's values)");
  m.def("pack_blocks", &pack_blocks, "Q4_1 / Q8_0 / Q6_S blocks in the int8 variants' packed layout (same shape)");
  m.def("unpack_blocks", &unpack_blocks, "packed blocks back in GGUF order");
  m.def("int8_variants_runnable", &int8_variants_runnable,
        "int8 variants built here that this CPU runs; test_only: those the dispatcher never picks");
  m.def("int8_variant", &int8_variant_name, "the int8 kernel variant in use (amx, avx512vnni, avx512, avxvnni, avx2, fp32)");
  m.def("int8_packed_weights_held", &int8_packed_weights_held, "packed weight copies the int8 kernel holds");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (float32, contiguous)");
  m.def("add_rms_norm", &add_rms_norm, "s = x + r; returns (s, rms_norm(s))");
  m.def("decode_attention", &decode_attention,
        "paged causal attention of q_lens[b] (default 1) query tokens per request (GQA, fp32); a quantized "
        "pool (int8 / float8) with its float16 block scales k_scale / v_scale",
        py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("kv_indices"), py::arg("seq_lens"),
        py::arg("kv_start"), py::arg("window"), py::arg("scale"),
        py::arg("q_lens") = std::vector<int64_t>(), py::arg("variant") = "", py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("sinks") = py::none());
  m.def("decode_attention_variants", &decode_attention_variants,
        "the decode_attention variants this CPU runs, best first (avx512vnni, avx512, avx2)");
  m.def("prefill_attention", &prefill_attention,
        "decode_attention for prefill chunks, in tiles of query rows (GQA, fp32); variant: avx512vnni / avx512 /"
        " avx2",
        py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("kv_indices"), py::arg("seq_lens"),
        py::arg("kv_start"), py::arg("window"), py::arg("scale"), py::arg("q_lens"), py::arg("variant") = "",
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("prefill_attention_variant", &prefill_attention_variant,
        "the variant prefill_attention runs (avx512vnni, avx512, avx2), or empty where none can");
  m.def("prefill_attention_variants", &prefill_attention_variants,
        "the prefill_attention variants this CPU runs, best first");
  m.def("prefill_attention_takes", &prefill_attention_takes,
        "whether prefill_attention runs here for H query heads over Hkv kv heads of head dim D",
        py::arg("H"), py::arg("Hkv"), py::arg("D"));
  m.def("markov_greedy", &markov_greedy,
        "a DSpark Markov head's greedy loop over a block: (target ids [B, G], previous-token codes [B, G, r])",
        py::arg("base"), py::arg("w1"), py::arg("w2p"), py::arg("d2t"), py::arg("anchors"));
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (a NaN's first), as torch.argmax(-1)");
  m.def("sample_rows", &sample_rows,
        "one id per listed row, drawn at u from its temperature / top_k / top_p / min_p distribution");
  m.def("logprob_rows", &logprob_rows,
        "per listed row: log_softmax at its id and its k best (values, ids), best first");
  m.def("markov_pack", &markov_pack, "a Markov head's W2 [V, r] in the layout markov_greedy reads");
  py::class_<sparkserve::NativeLayerOptions>(m, "NativeLayerOptions", "a layer's departures from a Llama layer")
      .def(py::init<>())
      .def_readwrite("attn_out_norm", &sparkserve::NativeLayerOptions::attn_out_norm)
      .def_readwrite("mlp_out_norm", &sparkserve::NativeLayerOptions::mlp_out_norm)
      .def_readwrite("o_bias", &sparkserve::NativeLayerOptions::o_bias)
      .def_readwrite("sinks", &sparkserve::NativeLayerOptions::sinks)
      .def_readwrite("qk_norm_full_width", &sparkserve::NativeLayerOptions::qk_norm_full_width)
      .def_readwrite("gelu", &sparkserve::NativeLayerOptions::gelu)
      .def_readwrite("rope", &sparkserve::NativeLayerOptions::rope)
      .def_readwrite("local_rope", &sparkserve::NativeLayerOptions::local_rope)
      .def_readwrite("window", &sparkserve::NativeLayerOptions::window);
  py::class_<sparkserve::NativeLlama>(m, "NativeLlama", "one call per forward of a Llama-family decoder")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &sparkserve::NativeLlama::add_layer)
      .def("add_layer_with", &sparkserve::NativeLlama::add_layer_with)
      .def("set_model_options", &sparkserve::NativeLlama::set_model_options)
      .def("set_layer_moe", &sparkserve::NativeLlama::set_layer_moe)
      .def("set_pool", &sparkserve::NativeLlama::set_pool)
      .def("set_pool_scales", &sparkserve::NativeLlama::set_pool_scales)
      .def("forward", &sparkserve::NativeLlama::forward);
  py::class_<sparkserve::NativeDraft, sparkserve::NativeLlama>(
      m, "NativeDraft",
      "a DSpark draft's block pass (forward), context injection and greedy draft pass, each one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor, at::Tensor,
                    at::Tensor, int64_t, std::optional<at::Tensor>, at::Tensor>())
      .def("inject", &sparkserve::NativeDraft::inject)
      .def("set_heads", &sparkserve::NativeDraft::set_heads)
      .def("propose", &sparkserve::NativeDraft::propose);
  py::class_<sparkserve::MoEExperts>(m, "MoEExperts", "a MoE layer's routed experts run for a few rows in one call")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, int64_t, double, double>())
      .def_static("dense", &sparkserve::MoEExperts::dense)
      .def("forward", &sparkserve::MoEExperts::forward);
  py::class_<sparkserve::NativeExperts>(m, "NativeExperts", "gated SiLU experts (MoE kernel or fp32) for NativeMLA")
      .def(py::init<const sparkserve::MoEExperts*, std::optional<at::Tensor>, std::optional<at::Tensor>>());
  py::class_<sparkserve::MLALayerWeights>(m, "MLALayerWeights", "a DeepSeek-V2 layer's attention weights")
      .def(py::init<>())
      .def_readwrite("input_norm", &sparkserve::MLALayerWeights::input_norm)
      .def_readwrite("mlp_norm", &sparkserve::MLALayerWeights::mlp_norm)
      .def_readwrite("q_a", &sparkserve::MLALayerWeights::q_a)
      .def_readwrite("q_a_bias", &sparkserve::MLALayerWeights::q_a_bias)
      .def_readwrite("q_a_norm", &sparkserve::MLALayerWeights::q_a_norm)
      .def_readwrite("q_a_type", &sparkserve::MLALayerWeights::q_a_type)
      .def_readwrite("q", &sparkserve::MLALayerWeights::q)
      .def_readwrite("q_type", &sparkserve::MLALayerWeights::q_type)
      .def_readwrite("kv_a", &sparkserve::MLALayerWeights::kv_a)
      .def_readwrite("kv_a_norm", &sparkserve::MLALayerWeights::kv_a_norm)
      .def_readwrite("kv_a_bias", &sparkserve::MLALayerWeights::kv_a_bias)
      .def_readwrite("kv_a_type", &sparkserve::MLALayerWeights::kv_a_type)
      .def_readwrite("kv_b", &sparkserve::MLALayerWeights::kv_b)
      .def_readwrite("k_b", &sparkserve::MLALayerWeights::k_b)
      .def_readwrite("k_b_type", &sparkserve::MLALayerWeights::k_b_type)
      .def_readwrite("v_b", &sparkserve::MLALayerWeights::v_b)
      .def_readwrite("v_b_type", &sparkserve::MLALayerWeights::v_b_type)
      .def_readwrite("o", &sparkserve::MLALayerWeights::o)
      .def_readwrite("o_bias", &sparkserve::MLALayerWeights::o_bias)
      .def_readwrite("o_type", &sparkserve::MLALayerWeights::o_type)
      .def_readwrite("q_a_eps", &sparkserve::MLALayerWeights::q_a_eps)
      .def_readwrite("kv_a_eps", &sparkserve::MLALayerWeights::kv_a_eps);
  m.def("absorbed_head_rows", &sparkserve::absorbed_head_rows,
        "per (token, head) a split MLA kv_b half's rows of that head (blocks) . x [T, heads, k]");
  py::class_<sparkserve::NativeMLA>(m, "NativeMLA", "one call per forward of a DeepSeek-V2 decoder")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor,
                    at::Tensor, at::Tensor>())
      .def("add_layer", &sparkserve::NativeMLA::add_layer)
      .def("set_dense_mlp", &sparkserve::NativeMLA::set_dense_mlp)
      .def("set_moe", &sparkserve::NativeMLA::set_moe)
      .def("set_pool", &sparkserve::NativeMLA::set_pool)
      .def("forward", &sparkserve::NativeMLA::forward);
}
