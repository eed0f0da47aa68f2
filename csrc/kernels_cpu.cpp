// Every CPU kernel in one extension module, built once per ISA flavour (csrc/cpp_build.py):
// one compile of torch's headers instead of one per kernel file, which is what lets the tests
// build and check every flavour the machine can run. ATen and torch's pybind11 casters are all
// the kernels need: torch/extension.h adds the C++ frontend (nn, optim, data), which took two
// thirds of the compile.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "awq_cpu.cpp"
#include "awq_int16_cpu.cpp"
#include "awq_int8_cpu.cpp"
#include "gemm_cpu.cpp"
#include "gemv_cpu.cpp"
#include "ggml_cpu.cpp"
#include "int8_cpu.cpp"
#include "layer_ops_cpu.cpp"
#include "paged_attention_cpu.cpp"
#include "bidirectional_attention_cpu.cpp"
#include "peak_cpu.cpp"
#include "sampling_cpu.cpp"
#include "decoder_cpu.cpp"

// The kernels that take a step's time (the decoder, the linears the Python layers and the LM
// heads call, attention) run without the GIL, so that the server's event loop (a thread of its
// own) parses, streams and answers /health while the engine's thread computes. Not the small
// per-layer ops: each release lets the loop take the GIL, and taking it back can wait for the
// loop's next switch. pybind11 converts the arguments before releasing it, the result after.
using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;

// module_local: each flavour's module registers its own CpuDecoder type, and a process may load
// several (the tests load every flavour the CPU runs).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = kIsa;
  m.attr("lanes") = kLanes;
  m.attr("awq_int16_max_group") = kMaxInt16Group;

  m.def("awq_linear", &awq_linear, "a 4-bit AWQ linear layer on CPU", nogil());
  m.def("awq_gemv", &awq_gemv, "fused 4-bit dequantize-GEMV, up to 8 rows per pass");
  m.def("awq_gemm", &awq_gemm, "4-bit AWQ GEMM by decoded panels, for many rows");
  m.attr("awq_gemv_max_rows") = kGemvMaxRows;
  m.attr("awq_int8_max_rows") = kInt8GemvMaxRows;
  m.def("awq_gemv_int16", &awq_gemv_int16, "4-bit AWQ GEMV with int16 activations (AVX2, AVX-512)");
  m.def("awq_gemv_int8", &awq_gemv_int8, "4-bit AWQ GEMV with int8 activations (AVX2, AVX-512)");
  m.def("awq_gemv_has_integer", &awq_gemv_has_integer,
        "whether this flavour has awq_gemv_int16 and awq_gemv_int8");
  m.attr("awq_int8_block") = kInt8Block;
  m.def("awq_dequantize", &awq_dequantize, "4-bit codes to a float32 W^T [K, N]");

  namespace py = pybind11;
  m.def("f32_gemv", &gemv::f32_gemv, "float32 GEMV of few rows on the plain [N, K] weight",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("out") = py::none());
  m.def("f32_linear", &gemv::f32_linear,
        "float32 linear on CPU: the GEMV at few rows, a GEMM above",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("out") = py::none(), nogil());
  m.attr("f32_gemv_max_rows") = gemv::kMaxRows;
  m.def("f32_gemm", &f32gemm::f32_gemm,
        "float32 GEMM on the plain [N, K] weight, broadcast against x^T in blocks",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("out") = py::none());
  m.attr("f32_gemm_max_rows") = f32gemm::kMaxRows;

  m.def("ggml_linear", &ggml::ggml_linear,
        "linear on weights in ggml's block formats (GGUF): a fused GEMV at few rows",
        py::arg("x"), py::arg("parts"), py::arg("types"), py::arg("bias") = py::none(),
        py::arg("out") = py::none(), py::arg("activation_bits") = 32, nogil());
  m.attr("ggml_gemv_max_rows") = ggml::kMaxRows;
  m.attr("ggml_int8_kquants") = ggml::kInt8KQuants;
  m.def("ggml_int8_tiles", &ggml::ggml_int8_tiles,
        "whether int8 activations take a layer of these ggml types in tiles at `rows` rows");
  m.attr("ggml_q8_0_groups") = ggml::kQ8Groups;  // Q8_0 at few rows of int8 x, grouped
  m.def("ggml_rows", &ggml::ggml_rows, "rows of a table in a ggml block format, as float32");
  m.def("ggml_dequantize", &ggml::ggml_dequantize, "a table in a ggml block format as float32");

  m.def("int8_gemv", &int8::int8_gemv, "weight-only int8 GEMV for any number of rows", nogil());
  m.attr("int8_gemv_max_rows") = int8::kGemvMaxRows;
  m.def("int8_gemm", &int8::int8_gemm, "weight-only int8 GEMM by widened panels, for many rows",
        nogil());
  m.def("int8_dequantize", &int8::int8_dequantize, "int8 codes to a float32 W^T [K, N]");

  m.def("rms_norm", &rms_norm, "RMSNorm of each row into out");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; x = RMSNorm(residual), in place");
  m.def("head_rms_norm", &head_rms_norm, "RMSNorm of each head of [T, H, D] into out");
  m.def("rotary", &rotary, "rotate-half RoPE on q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up into out");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up into out");

  m.def("paged_attention", &paged_attention, "paged attention over block tables (CPU)", nogil());
  m.def("bidirectional_attention", &bidirectional_attention,
        "encoders' attention: each prompt's rows over all of its own rows (CPU)", nogil());

  m.def("first_argmax", &first_argmax, "each row's first maximum (argmax, NaN first)");

  m.def("fma_peak_gflops", &fma_peak_gflops, "float32 multiply-add peak of all threads");

  pybind11::class_<CpuDecoder>(m, "CpuDecoder", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, int64_t, int64_t,
                          const OptTensor&>())
      .def("add_layer", &CpuDecoder::add_layer)
      .def("set_lora", &CpuDecoder::set_lora)
      .def("set_lora_segments", &CpuDecoder::set_lora_segments)
      .def("forward", &CpuDecoder::forward, nogil())
      .def("forward_stage", &CpuDecoder::forward_stage, nogil());
}
