// Python bindings of the kernels (one extension module, built by build.py).
#include <torch/extension.h>

#include <optional>
#include <tuple>

at::Tensor quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, std::optional<at::Tensor> bias);
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor r, at::Tensor w, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x @ W.T with W in GGUF blocks (Q4_1, Q8_0, BF16)",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (float32, contiguous)");
  m.def("add_rms_norm", &add_rms_norm, "s = x + r; returns (s, rms_norm(s))");
}
