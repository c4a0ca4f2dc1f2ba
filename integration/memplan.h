/* memplan.h: memplan's C API, for C and C++ trainers and for other languages' FFIs.
 *
 * Everything a script gets from the CLI's --format json, as functions: estimate and plan take a
 * JSON request and give back the same JSON document the CLI prints (integration/requests.h
 * documents the request keys). The offload engine (offload/engine.h) is a handle with
 * open / register / start / fetch / release / grad-ready / step / stats / close.
 *
 * Conventions
 *   - Every function returns memplan_status; MEMPLAN_OK (0) is success. After a failure,
 *     memplan_last_error() gives the message (thread-local, valid until the thread's next call).
 *   - Strings handed out (char** out parameters) are NUL-terminated UTF-8, allocated by memplan,
 *     freed with memplan_string_free(). On failure *out is set to NULL.
 *   - ABI: MEMPLAN_ABI_VERSION changes when a function's signature or meaning changes; functions
 *     are only added within a version. Check memplan_abi_version() == MEMPLAN_ABI_VERSION at start.
 *   - Thread safety: the stateless functions may be called from any thread. One engine handle is
 *     driven by one thread at a time (it runs its own transfer and I/O threads).
 */
#ifndef MEMPLAN_MEMPLAN_H_
#define MEMPLAN_MEMPLAN_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MEMPLAN_ABI_VERSION 1

typedef enum memplan_status {
  MEMPLAN_OK = 0,
  MEMPLAN_INVALID_ARGUMENT = 1,    /* bad request, flag or file content */
  MEMPLAN_NOT_FOUND = 2,           /* a file, model or key that does not exist */
  MEMPLAN_IO_ERROR = 3,            /* the OS refused a read or write */
  MEMPLAN_OUT_OF_RANGE = 4,        /* a number too large, an overflow */
  MEMPLAN_FAILED_PRECONDITION = 5, /* not in a state to do this (e.g. fetch before start) */
  MEMPLAN_RESOURCE_EXHAUSTED = 6,  /* memory, disk, a budget */
  MEMPLAN_UNIMPLEMENTED = 7,
  MEMPLAN_DATA_LOSS = 8,   /* stored data corrupt or lost */
  MEMPLAN_UNAVAILABLE = 9, /* transient, or a component not built in (CUDA) */
  MEMPLAN_INTERNAL = 10    /* a bug in memplan */
} memplan_status;

/* Element types of gradients given to memplan_engine_grad_ready. */
typedef enum memplan_dtype {
  MEMPLAN_FLOAT32 = 0,
  MEMPLAN_BFLOAT16 = 1,
  MEMPLAN_FLOAT16 = 2
} memplan_dtype;

uint32_t memplan_abi_version(void);
const char* memplan_version(void);                      /* "0.1.0"; static storage */
const char* memplan_status_name(memplan_status status); /* "INVALID_ARGUMENT"; static storage */
/* The message of this thread's last failed call ("" when none). */
const char* memplan_last_error(void);
void memplan_string_free(char* text);

/* ---- Estimate and plan ------------------------------------------------------------------------
 */

/* `request_json`: an estimate request (integration/requests.h); *answer_json: the document
 * `memplan estimate --format json` prints. */
memplan_status memplan_estimate_json(const char* request_json, char** answer_json);
/* Shorthand: the model-state estimate of a config.json (or any --model spec: built-in name,
 * shape list, safetensors) for `gpus_per_node` x `nodes` GPUs. */
memplan_status memplan_estimate_path(const char* model, int64_t gpus_per_node, int64_t nodes,
                                     char** answer_json);
/* `request_json`: a plan request; *answer_json: `memplan plan --format json`'s document. */
memplan_status memplan_plan_json(const char* request_json, char** answer_json);
/* `request_json`: a capacity request (integration/requests.h); *answer_json: the document
 * `memplan capacity --format json` prints. */
memplan_status memplan_capacity_json(const char* request_json, char** answer_json);

/* ---- Offload engine ---------------------------------------------------------------------------
 */

typedef struct memplan_engine memplan_engine;

/* Streams (offload/engine.h, "Streams"). The engine copies on CUDA streams of its own; a trainer
 * computes on streams of its own. Calls that hand over GPU memory the trainer's kernels use say
 * which stream (a cudaStream_t, as void*) those kernels were queued on: the engine orders its
 * copies after that stream's work (it never waits for it on a thread). NULL is CUDA's legacy
 * default stream (PyTorch's default stream); the functions without a stream argument use it. On
 * the host runtime there are no streams: pass NULL.
 *   - memplan_engine_fetch returns when the parameters are on the GPU: any stream may use them.
 *   - memplan_engine_release_on_stream: the module's buffers are not reused before the work queued
 *     on `stream` so far has run (a trainer may release right after launching its kernels).
 *   - memplan_engine_grad_ready_on_stream: the copy of `grad` starts after the work queued on
 *     `stream`; it reads `grad` on the engine's gradient stream (memplan_engine_gradient_stream),
 *     so the trainer must not write or free `grad` until that stream has done so (record the
 *     memory on it, as PyTorch's tensor.record_stream does, or keep `grad` until step). */

/* Opens an engine for a Schedule (its JSON form, README "Schedule JSON"). `options_json` may be
 * NULL or {"runtime": "auto" | "host" | "cuda", "resume": false, "device": null}: "device" is the
 * CUDA device ordinal, null (the default) the calling thread's current device. */
memplan_status memplan_engine_open(const char* schedule_json, const char* options_json,
                                   memplan_engine** engine);
/* Registers a parameter (before start): a unique `name`, the `module` whose fetch brings it,
 * its shape, and its initial fp32 values (`init`, product(shape) floats; NULL: zeros). `init` is
 * read during memplan_engine_start, so it must stay valid until then. */
memplan_status memplan_engine_register(memplan_engine* engine, const char* name, const char* module,
                                       const int64_t* shape, int32_t ndim, const float* init,
                                       uint32_t* param_id);
/* Another module that uses the same (tied) parameter; before start. */
memplan_status memplan_engine_add_use(memplan_engine* engine, uint32_t param_id,
                                      const char* module);
/* Marks a registered parameter frozen (before start): held and fetched like the others, on the
 * Schedule's tier, but never given a gradient (grad_ready refuses it), never stepped, never
 * written after start, with no optimizer state (LoRA's base weights); read_master refuses it. */
memplan_status memplan_engine_freeze(memplan_engine* engine, uint32_t param_id);
/* Puts a registered parameter in parameter group `group` (before start; 0 .. 1023, default 0):
 * the step options' "groups" entry of that index steps it (integration/engine_json.h; torch.optim's
 * param_groups, e.g. no weight decay for biases and norms). */
memplan_status memplan_engine_set_group(memplan_engine* engine, uint32_t param_id, uint32_t group);
/* Creates the stores and writes the initial values (or, with resume, recovers them; a resume onto
 * a store written for other parameters, in name, order, shape or frozen set, is refused). */
memplan_status memplan_engine_start(memplan_engine* engine);
memplan_status memplan_engine_fetch(memplan_engine* engine, const char* module);
/* memplan_engine_release_on_stream with the legacy default stream (NULL). */
memplan_status memplan_engine_release(memplan_engine* engine, const char* module);
/* Releases a fetched module; its kernels were queued on `stream` (see Streams above). */
memplan_status memplan_engine_release_on_stream(memplan_engine* engine, const char* module,
                                                void* stream);
/* The device address of a fetched parameter's working copy (the Schedule's params.dtype). */
memplan_status memplan_engine_device_pointer(memplan_engine* engine, uint32_t param_id,
                                             void** pointer);
/* Number of elements of a registered parameter. */
memplan_status memplan_engine_numel(memplan_engine* engine, uint32_t param_id, uint64_t* numel);
/* The gradient of `param_id` for this step: numel elements of `dtype` in device memory, written
 * on the legacy default stream; it must stay valid and unchanged until memplan_engine_step (or
 * until the gradient stream has read it, see Streams above). */
memplan_status memplan_engine_grad_ready(memplan_engine* engine, uint32_t param_id,
                                         const void* grad, memplan_dtype dtype);
/* memplan_engine_grad_ready for a gradient written by work queued on `stream`. */
memplan_status memplan_engine_grad_ready_on_stream(memplan_engine* engine, uint32_t param_id,
                                                   const void* grad, memplan_dtype dtype,
                                                   void* stream);
/* The stream the engine's gradient copies read on (a cudaStream_t; NULL on the host runtime). */
memplan_status memplan_engine_gradient_stream(memplan_engine* engine, void** stream);
/* `param_id` has no gradient this step (torch: grad None): memplan_engine_step skips it, leaving
 * its weights, optimizer states and step count unchanged, as torch's optimizers do. Instead of
 * grad_ready, before step; every rank must skip the same parameters. */
memplan_status memplan_engine_no_gradient(memplan_engine* engine, uint32_t param_id);
/* One optimizer step; `options_json` (NULL: defaults) as integration/engine_json.h: the
 * optimizer's options, per parameter group ("groups"), gradient clipping by the global norm
 * ("max_grad_norm", "norm_type") and skipping a step whose gradients overflowed ("skip_nonfinite",
 * for loss scaling; the stats' last_step_skipped says so). After memplan_engine_prepare_step the
 * options must be the prepared ones (FAILED_PRECONDITION otherwise, and the step is abandoned:
 * run its forward and backward again). */
memplan_status memplan_engine_step(memplan_engine* engine, const char* options_json);
/* The options of the coming memplan_engine_step, given before the step's first gradient: the
 * engine then steps each optimizer sub-group during backward, as soon as its gradients are in
 * (the optimizer on nvme; results identical to the serial step), clipping included (the step is
 * run again when the norm says it must clip). A failure of the prepared step is returned by
 * memplan_engine_step, which abandons it (nothing committed, the weights as before the step). */
memplan_status memplan_engine_prepare_step(memplan_engine* engine, const char* options_json);
/* The global norm (`norm_type` 1, 2 or INFINITY) of this step's gradients divided by
 * `grad_scale` (their loss scale; 1 without), over every rank (a collective): what
 * torch.nn.utils.clip_grad_norm_ returns. Every gradient must have been given (or declared with
 * no_gradient). NaN or inf when a gradient holds one. */
memplan_status memplan_engine_gradient_norm(memplan_engine* engine, double norm_type,
                                            double grad_scale, double* norm);
/* Drops the step in progress (its gradients, a prepared step's work), so that the next step
 * starts clean: after an error in the trainer's backward, or a step it decides to skip. */
memplan_status memplan_engine_abandon_step(memplan_engine* engine);
/* Checkpoints. This rank's shard of a parameter in the optimizer: elements [*first, *first +
 * *size) of the flattened parameter (past its numel: padding). */
memplan_status memplan_engine_shard(memplan_engine* engine, uint32_t param_id, uint64_t* first,
                                    uint64_t* size);
/* The number of optimizer state arrays besides the master weights (Adam: 2, exp_avg and
 * exp_avg_sq; 3 with amsgrad; SGD and Lion 1). */
memplan_status memplan_engine_optimizer_states(memplan_engine* engine, int32_t* states);
/* Reads this rank's shard of array `array` (0: the fp32 master weights; 1..states: the optimizer's
 * states) of a trainable parameter, between steps; `count` must be the shard's size. */
memplan_status memplan_engine_read_state(memplan_engine* engine, uint32_t param_id, int32_t array,
                                         float* out, uint64_t count);
/* A trainable parameter's own step count (torch's state["step"]). */
memplan_status memplan_engine_param_step(memplan_engine* engine, uint32_t param_id, uint64_t* step);
/* Fills elements [first, first + count) of this rank's shard of `array` of `param_id` into `out`;
 * returns 0, or non-zero to fail the load (with a message through memplan_last_error's caller). */
typedef int (*memplan_state_filler)(void* user, uint32_t param_id, int32_t array, uint64_t first,
                                    float* out, uint64_t count);
/* Replaces, between steps, the arrays `arrays[k] != 0` says (1 + states flags) of every trainable
 * parameter, and with arrays[0] the frozen ones' values, from `fill`; `steps` (NULL, or one count
 * per registered parameter) replaces the step counts. All or nothing for the trainable ones (on
 * NVMe one committed step). The working parameters are rewritten. */
memplan_status memplan_engine_load_state(memplan_engine* engine, memplan_state_filler fill,
                                         void* user, const uint8_t* arrays, int32_t narrays,
                                         const uint64_t* steps, uint64_t nsteps);
/* Copies a parameter's fp32 master weights into `out` (`count` must be its numel). */
memplan_status memplan_engine_read_master(memplan_engine* engine, uint32_t param_id, float* out,
                                          uint64_t count);
/* Statistics as JSON (integration/engine_json.h). */
memplan_status memplan_engine_stats_json(memplan_engine* engine, char** stats_json);
/* Commits and closes the engine and frees the handle (NULL is a no-op). The status is that of the
 * commit; the handle is freed either way. */
memplan_status memplan_engine_close(memplan_engine* engine);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MEMPLAN_MEMPLAN_H_ */
