// Python bindings of tierstate._native: the only file that includes nanobind.
// Kernels and the I/O engine are plain C++ behind csrc/kernels/kernels.h and
// csrc/io/engine.h; each section below only converts arguments and releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

namespace nb = nanobind;

// ---- kernels section ------------------------------------------------------
#include <cstdint>
#include <stdexcept>

#include "kernels/kernels.h"

// The Python faces (tierstate/kernels/) validate the tensors and pass raw data
// pointers, element counts and dtype codes (0 fp32, 1 bf16, 2 fp16, 3 none); a
// null pointer (0) means "absent". The kernels run with the GIL released.
static void bind_kernels(nb::module_& m) {
  namespace k = tierstate::kernels;
  using ptr = uintptr_t;
  auto as_dtype = [](int code) { return static_cast<k::DType>(code); };
  nb::module_ km = m.def_submodule("kernels", "optimizer kernels over raw CPU buffers");

  km.def(
      "adam_update",
      [as_dtype](ptr weight, ptr grad, ptr exp_avg, ptr exp_avg_sq, ptr max_exp_avg_sq,
                 ptr weight_out, int64_t n, int grad_dtype, int moment_dtype, int out_dtype,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool decoupled, double bias_correction1, double bias_correction2, bool maximize,
                 double grad_scale) {
        const k::AdamParams p{lr, beta1, beta2, eps, weight_decay, decoupled,
                              bias_correction1, bias_correction2, maximize, grad_scale};
        nb::gil_scoped_release release;
        k::adam_update(reinterpret_cast<float*>(weight), reinterpret_cast<const void*>(grad),
                       reinterpret_cast<void*>(exp_avg), reinterpret_cast<void*>(exp_avg_sq),
                       reinterpret_cast<void*>(max_exp_avg_sq), reinterpret_cast<void*>(weight_out),
                       n, as_dtype(grad_dtype), as_dtype(moment_dtype), as_dtype(out_dtype), p);
      },
      "Adam/AdamW over n elements at raw addresses (see tierstate.kernels.adam_update).");

  // One row of int64 per job: weight, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, weight_out
  // (addresses, 0 = absent), n, grad dtype, moment dtype, out dtype, and the index of its
  // row in `params`; one row of 10 floats per distinct hyper-parameter set: lr, beta1,
  // beta2, eps, weight_decay, decoupled, bias_correction1, bias_correction2, maximize,
  // grad_scale. Flat lists: the engine builds them per step (tierstate.kernels.adam_update_many).
  km.def(
      "adam_update_many",
      [as_dtype](const std::vector<int64_t>& jobs, const std::vector<double>& params) {
        constexpr size_t kJob = 11, kParams = 10;
        if (jobs.size() % kJob != 0 || params.size() % kParams != 0)
          throw std::invalid_argument("adam_update_many: jobs must hold rows of 11 ints, params rows of 10 floats");
        std::vector<k::AdamJob> out(jobs.size() / kJob);
        const size_t n_params = params.size() / kParams;
        for (size_t j = 0; j < out.size(); ++j) {
          const int64_t* r = jobs.data() + j * kJob;
          if (r[10] < 0 || static_cast<size_t>(r[10]) >= n_params)
            throw std::invalid_argument("adam_update_many: a job names a params row that does not exist");
          const double* q = params.data() + static_cast<size_t>(r[10]) * kParams;
          out[j] = k::AdamJob{reinterpret_cast<float*>(r[0]), reinterpret_cast<const void*>(r[1]),
                              reinterpret_cast<void*>(r[2]), reinterpret_cast<void*>(r[3]),
                              reinterpret_cast<void*>(r[4]), reinterpret_cast<void*>(r[5]), r[6],
                              as_dtype(static_cast<int>(r[7])), as_dtype(static_cast<int>(r[8])),
                              as_dtype(static_cast<int>(r[9])),
                              k::AdamParams{q[0], q[1], q[2], q[3], q[4], q[5] != 0.0, q[6], q[7], q[8] != 0.0, q[9]}};
        }
        nb::gil_scoped_release release;
        k::adam_update_many(out.data(), static_cast<int64_t>(out.size()));
      },
      "adam_update over many buffers in one pass of the thread pool (see tierstate.kernels.adam_update_many).");

  km.def(
      "lion_update",
      [as_dtype](ptr weight, ptr grad, ptr exp_avg, ptr weight_out, int64_t n, int grad_dtype,
                 int moment_dtype, int out_dtype, double lr, double beta1, double beta2,
                 double weight_decay, bool maximize, double grad_scale) {
        const k::LionParams p{lr, beta1, beta2, weight_decay, maximize, grad_scale};
        nb::gil_scoped_release release;
        k::lion_update(reinterpret_cast<float*>(weight), reinterpret_cast<const void*>(grad),
                       reinterpret_cast<void*>(exp_avg), reinterpret_cast<void*>(weight_out), n,
                       as_dtype(grad_dtype), as_dtype(moment_dtype), as_dtype(out_dtype), p);
      },
      "Lion over n elements at raw addresses (see tierstate.kernels.lion_update).");

  km.def(
      "sgd_update",
      [as_dtype](ptr weight, ptr grad, ptr momentum_buffer, ptr weight_out, int64_t n,
                 int grad_dtype, int moment_dtype, int out_dtype, double lr, double momentum,
                 double dampening, double weight_decay, bool nesterov, bool maximize,
                 bool first_step, double grad_scale) {
        const k::SgdParams p{lr, momentum, dampening, weight_decay, nesterov, maximize,
                             first_step, grad_scale};
        nb::gil_scoped_release release;
        k::sgd_update(reinterpret_cast<float*>(weight), reinterpret_cast<const void*>(grad),
                      reinterpret_cast<void*>(momentum_buffer), reinterpret_cast<void*>(weight_out),
                      n, as_dtype(grad_dtype), as_dtype(moment_dtype), as_dtype(out_dtype), p);
      },
      "SGD (momentum, Nesterov) over n elements at raw addresses (see tierstate.kernels.sgd_update).");

  km.def(
      "adagrad_update",
      [as_dtype](ptr weight, ptr grad, ptr state_sum, ptr weight_out, int64_t n, int grad_dtype,
                 int moment_dtype, int out_dtype, double clr, double weight_decay, double eps,
                 bool maximize, double grad_scale) {
        const k::AdagradParams p{clr, weight_decay, eps, maximize, grad_scale};
        nb::gil_scoped_release release;
        k::adagrad_update(reinterpret_cast<float*>(weight), reinterpret_cast<const void*>(grad),
                          reinterpret_cast<void*>(state_sum), reinterpret_cast<void*>(weight_out),
                          n, as_dtype(grad_dtype), as_dtype(moment_dtype), as_dtype(out_dtype), p);
      },
      "Adagrad over n elements at raw addresses (see tierstate.kernels.adagrad_update).");

  km.def(
      "grad_sumsq",
      [as_dtype](ptr grad, int64_t n, int grad_dtype, double scale) {
        nb::gil_scoped_release release;
        return k::grad_sumsq(reinterpret_cast<const void*>(grad), n, as_dtype(grad_dtype), scale);
      },
      "Sum of (grad * scale)^2 in float64 (see tierstate.kernels.grad_sumsq).");

  // A quantization map travels as (table, lut addresses, lut_size, lut_shift, lut_base,
  // signed, fp8 mantissa bits, top); tierstate/kernels/quant_maps.py owns the arrays.
  using MapArgs = std::tuple<ptr, ptr, int32_t, int32_t, int32_t, bool, int32_t, float>;
  auto as_map = [](const MapArgs& a) {
    return k::QuantMapRef{reinterpret_cast<const float*>(std::get<0>(a)),
                          reinterpret_cast<const uint32_t*>(std::get<1>(a)), std::get<2>(a), std::get<3>(a),
                          std::get<4>(a), std::get<5>(a), std::get<6>(a), std::get<7>(a)};
  };

  km.def(
      "adam_q8_update",
      [as_dtype, as_map](ptr master, ptr master_comp, ptr grad, ptr m_codes, ptr m_scale, ptr v_codes,
                         ptr v_scale, ptr weight_out, int64_t n, int grad_dtype, int out_dtype,
                         const MapArgs& m_map, const MapArgs& v_map, double lr, double beta1,
                         double beta2, double eps, double weight_decay, bool decoupled,
                         double bias_correction1, double bias_correction2, bool maximize,
                         double grad_scale, int64_t block_size, int master_mode, uint32_t sr_key,
                         uint32_t index_offset) {
        const k::AdamQ8Params p{{lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction1,
                                 bias_correction2, maximize, grad_scale},
                                block_size, static_cast<k::MasterMode>(master_mode), sr_key, index_offset};
        const k::QuantMapRef mm = as_map(m_map), vm = as_map(v_map);
        nb::gil_scoped_release release;
        k::adam_q8_update(reinterpret_cast<void*>(master), reinterpret_cast<void*>(master_comp),
                          reinterpret_cast<const void*>(grad), reinterpret_cast<uint8_t*>(m_codes),
                          reinterpret_cast<float*>(m_scale), reinterpret_cast<uint8_t*>(v_codes),
                          reinterpret_cast<float*>(v_scale), reinterpret_cast<void*>(weight_out), n,
                          as_dtype(grad_dtype), as_dtype(out_dtype), mm, vm, p);
      },
      "Adam/AdamW on 8-bit blockwise moments (see tierstate.kernels.quant).");

  km.def(
      "quantize_blockwise",
      [as_map](ptr x, ptr codes, ptr scale, int64_t n, int64_t block_size, const MapArgs& map) {
        const k::QuantMapRef m = as_map(map);
        nb::gil_scoped_release release;
        k::quantize_blockwise(reinterpret_cast<const float*>(x), reinterpret_cast<uint8_t*>(codes),
                              reinterpret_cast<float*>(scale), n, block_size, m);
      },
      "Blockwise 8-bit codes and fp32 absmax scales of n fp32 values (see tierstate.kernels.quant).");

  km.def(
      "dequantize_blockwise",
      [as_map](ptr codes, ptr scale, ptr out, int64_t n, int64_t block_size, const MapArgs& map) {
        const k::QuantMapRef m = as_map(map);
        nb::gil_scoped_release release;
        k::dequantize_blockwise(reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const float*>(scale),
                                reinterpret_cast<float*>(out), n, block_size, m);
      },
      "fp32 values of blockwise 8-bit codes (see tierstate.kernels.quant).");

  km.def(
      "dequantize_groups",
      [as_dtype](ptr codes, ptr scale, ptr out, int64_t n, int64_t group, int bits, int out_dtype) {
        const k::DType od = as_dtype(out_dtype);
        nb::gil_scoped_release release;
        k::dequantize_groups(reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const float*>(scale),
                             reinterpret_cast<void*>(out), n, group, bits, od);
      },
      "Group-wise int8 / int4 weight codes times their fp32 scales (see tierstate.generate.compress).");

  km.def(
      "decode_exp4_bf16",
      [](ptr sign_mantissa, ptr codes, uint32_t base, ptr out, int64_t n, ptr escape_index, ptr escape_exponent,
         int64_t escapes, int64_t part_nbytes, uint32_t crc) {
        nb::gil_scoped_release release;
        return k::decode_exp4_bf16(reinterpret_cast<const uint8_t*>(sign_mantissa),
                                   reinterpret_cast<const uint8_t*>(codes), base, reinterpret_cast<uint16_t*>(out), n,
                                   reinterpret_cast<const uint32_t*>(escape_index),
                                   reinterpret_cast<const uint8_t*>(escape_exponent), escapes, part_nbytes, crc);
      },
      "bf16 values from sign+mantissa bytes and 4-bit exponent codes (see tierstate.generate.lossless); with "
      "part_nbytes >= 0 (else -1), returns the CRC-32C of the part's bytes continued from crc, taken as they are decoded.");

  km.def(
      "exponent_histogram_bf16",
      [](ptr src, int64_t n, ptr hist) {
        nb::gil_scoped_release release;
        k::exponent_histogram_bf16(reinterpret_cast<const uint16_t*>(src), n, reinterpret_cast<int64_t*>(hist));
      },
      "How many of n bf16 values have each exponent byte (256 int64 counts; see tierstate.generate.lossless).");
  km.def(
      "encode_exp4_bf16",
      [](ptr src, int64_t n, uint32_t base, ptr sign_mantissa, ptr codes, ptr escape_index, ptr escape_exponent,
         int64_t escape_room) {
        nb::gil_scoped_release release;
        return k::encode_exp4_bf16(reinterpret_cast<const uint16_t*>(src), n, base,
                                   reinterpret_cast<uint8_t*>(sign_mantissa), reinterpret_cast<uint8_t*>(codes),
                                   reinterpret_cast<uint32_t*>(escape_index),
                                   reinterpret_cast<uint8_t*>(escape_exponent), escape_room);
      },
      "Sign+mantissa bytes, 4-bit exponent codes and escapes of n bf16 values; returns the escapes found "
      "(see tierstate.generate.lossless).");

  km.def("available_isas", &k::available_isas, "ISA variants this CPU and build can run, widest first.");
  km.def("current_isa", &k::current_isa, "The ISA variant the kernels use now.");
  km.def("set_isa", &k::set_isa, nb::arg("name"),
         "Use an ISA variant ('auto' picks the widest supported); raises ValueError otherwise.");
  km.def(
      "set_num_threads",
      [](int n) {
        nb::gil_scoped_release release;  // waits for a running kernel to finish
        k::set_num_threads(n);
      },
      nb::arg("n"), "Threads used per kernel call, the caller included.");
  km.def("num_threads", &k::num_threads, "Threads used per kernel call, the caller included.");
  km.def("q8_table_lookup", &k::q8_table_lookup,
         "How the current ISA variant looks up table-map codes: 'gather', 'loads' or 'untimed'.");
  km.def("set_q8_table_lookup", &k::set_q8_table_lookup, nb::arg("mode"),
         "'auto' (time both at first use), 'gather' or 'loads'; raises ValueError otherwise.");
  km.def("q8_row_decode", &k::q8_row_decode,
         "Whether the current ISA variant decodes table-map codes a block at a time (AVX512-VBMI).");
  km.def("set_q8_row_decode", &k::set_q8_row_decode, nb::arg("on"),
         "Allow (True, the default) or forbid the block-at-a-time decode of table-map codes.");
  km.def("record_worker_spans", &k::record_worker_spans, nb::arg("on"),
         "Start (True) or stop and discard (False) recording per-thread busy spans of kernel calls.");
  km.def("drain_worker_spans", &k::drain_worker_spans,
         "The recorded spans as (thread, start_ns, end_ns), CLOCK_MONOTONIC; clears them.");
}

// ---- io section -----------------------------------------------------------
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/tuple.h>

#include "io/crc32c.h"
#include "io/engine.h"

// IoError becomes OSError(errno, message, path): Python picks the errno's subclass
// (FileNotFoundError, PermissionError, ...); tierstate.io adds the file offset.
static void translate_io_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const tierstate::io::IoError& e) {
    PyObject* args = e.path.empty() ? Py_BuildValue("(is)", e.err, e.what())
                                    : Py_BuildValue("(iss)", e.err, e.what(), e.path.c_str());
    PyErr_SetObject(PyExc_OSError, args);
    Py_XDECREF(args);
  }
}

static void bind_io(nb::module_& m) {
  namespace tio = tierstate::io;
  using namespace nb::literals;
  nb::register_exception_translator(translate_io_error);

  nb::class_<tio::File>(m, "IOFile", "An open file of the I/O engine (O_DIRECT when allowed).")
      .def(nb::init<const std::string&, int, unsigned, bool>(), "path"_a, "flags"_a, "perm"_a,
           "direct"_a)
      .def("close", &tio::File::close, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("closed", &tio::File::closed)
      .def("size", &tio::File::size)
      .def("truncate", &tio::File::truncate, "nbytes"_a)
      .def("sync", &tio::File::sync, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("path", &tio::File::path)
      .def_prop_ro("direct", &tio::File::direct)
      .def_prop_ro("direct_note", &tio::File::direct_note)
      .def_prop_ro("mem_align", &tio::File::mem_align)
      .def_prop_ro("offset_align", &tio::File::offset_align)
      .def_prop_ro("alignment_source", &tio::File::alignment_source)
      .def("stats", [](const tio::File& f) {
        return std::make_tuple(f.bytes_direct.load(), f.bytes_bounced.load(), f.bytes_buffered.load());
      });

  nb::class_<tio::Request>(m, "IORequest", "Completion state of one submitted read or write.")
      .def("done", &tio::Request::done)
      .def("wait", [](tio::Request& r) {
        tio::Request::Result res;
        {
          nb::gil_scoped_release nogil;
          res = r.wait();
        }
        return std::make_tuple(res.bytes, res.err, res.err_offset);
      })
      .def("crc", [](const tio::Request& r) {
        try {
          return r.crc();
        } catch (const std::logic_error& e) {
          throw nb::value_error(e.what());
        }
      }, "CRC-32C of the bytes moved (a request submitted with checksum=True, once done).");

  nb::class_<tio::Engine>(m, "IOEngine", "Thread pool or io_uring workers doing direct I/O.")
      .def("__init__",
           [](tio::Engine* self, int threads, int queue_depth, size_t block_size, const std::string& backend) {
             tio::EngineConfig c;
             c.threads = threads;
             c.queue_depth = queue_depth;
             c.block_size = block_size;
             c.backend = backend;
             new (self) tio::Engine(c);
           },
           "threads"_a, "queue_depth"_a, "block_size"_a, "backend"_a)
      .def("submit",
           [](tio::Engine& e, const std::shared_ptr<tio::File>& f, bool write, uintptr_t address,
              size_t nbytes, int64_t offset, bool checksum) {
             return e.submit(f, write, reinterpret_cast<void*>(address), nbytes, offset, checksum);
           },
           "file"_a, "write"_a, "address"_a, "nbytes"_a, "offset"_a, "checksum"_a = false,
           nb::call_guard<nb::gil_scoped_release>())
      .def("shutdown", &tio::Engine::shutdown, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("backend", &tio::Engine::backend)
      .def_prop_ro("backend_note", &tio::Engine::backend_note)
      .def_prop_ro("threads", [](const tio::Engine& e) { return e.config().threads; })
      .def_prop_ro("queue_depth", [](const tio::Engine& e) { return e.config().queue_depth; })
      .def_prop_ro("block_size", [](const tio::Engine& e) { return e.config().block_size; });

  m.def("io_probe_uring", [](unsigned queue_depth) {
    tio::UringProbe p = tio::probe_uring(queue_depth);
    return std::make_tuple(p.ok, p.note);
  }, "queue_depth"_a = 32);

  m.def("io_crc32c", [](uintptr_t address, size_t nbytes, uint32_t crc, const std::string& isa) {
    const void* p = reinterpret_cast<const void*>(address);
    return isa.empty() ? tio::crc32c(crc, p, nbytes) : tio::crc32c_with(isa, crc, p, nbytes);
  }, "address"_a, "nbytes"_a, "crc"_a = 0, "isa"_a = "", nb::call_guard<nb::gil_scoped_release>(),
     "CRC-32C of nbytes at address, continuing from crc; isa '' picks the fastest variant.");
  m.def("io_crc32c_isas", &tio::crc32c_isas, "CRC-32C variants this CPU and build can run, fastest first.");

  m.def("io_aligned_empty", [](size_t nbytes, size_t alignment, bool huge_pages) {
    void* p = tio::aligned_alloc_bytes(nbytes, alignment, huge_pages);
    nb::capsule owner(p, [](void* q) noexcept { tio::aligned_free(q); });
    size_t shape[1] = {nbytes};
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(p, 1, shape, owner);
  }, "nbytes"_a, "alignment"_a, "huge_pages"_a = false,
     "Uninitialised aligned host memory as a numpy uint8 array: with huge_pages a fresh mapping advised "
     "MADV_HUGEPAGE before first touch, else posix_memalign.");
}

NB_MODULE(_native, m) {
  m.doc() = "tierstate native core: optimizer kernels and the direct-I/O engine";
  bind_kernels(m);
  bind_io(m);
}
