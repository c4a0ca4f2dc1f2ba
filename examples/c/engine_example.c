/* engine_example.c: memplan's C API from a C program, start to finish.
 *
 *   1. Ask the estimator how much memory a built-in model's states need (the same JSON document
 *      `memplan estimate --format json` prints) and pick one number out of it.
 *   2. Train a tiny two-layer linear model with the offload engine: its 16-bit parameters live on
 *      NVMe (in the directory given as argv[1]) and are fetched per layer; the fp32 master weights
 *      and Adam states live on NVMe too; the trainer computes gradients and hands them over; the
 *      engine's CPU optimizer steps.
 *
 * Usage: c_engine_example DIR      (DIR: an existing directory the engine may fill)
 * Exits 0 when every call succeeded and the loss went down, 1 otherwise.
 *
 * The engine runs on the host-only runtime, where "device" memory is ordinary host memory, so
 * this program can read the fetched parameters and write gradients with plain C. With the CUDA
 * runtime the same pointers would be given to kernels instead.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memplan.h"

/* Every memplan call returns a memplan_status; on failure memplan_last_error() says why. */
#define CHECK(call)                                                               \
  do {                                                                            \
    memplan_status status_ = (call);                                              \
    if (status_ != MEMPLAN_OK) {                                                  \
      fprintf(stderr, "%s failed: %s: %s\n", #call, memplan_status_name(status_), \
              memplan_last_error());                                              \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

enum { kIn = 3, kHidden = 4, kSamples = 8, kSteps = 8 };

/* The working copies are bf16 (params.dtype): the top half of an IEEE float's bits. */
static float Bf16(const void* base, int i) {
  uint32_t bits = (uint32_t)((const uint16_t*)base)[i] << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

int main(int argc, char** argv) {
  if (argc != 2 || strpbrk(argv[1], "\"\\") != NULL) {
    fprintf(stderr, "usage: %s DIR  (a directory without quotes or backslashes in its name)\n",
            argv[0]);
    return 1;
  }
  if (memplan_abi_version() != MEMPLAN_ABI_VERSION) {
    fprintf(stderr, "libmemplan_c has ABI %u, this program was built for %d\n",
            (unsigned)memplan_abi_version(), MEMPLAN_ABI_VERSION);
    return 1;
  }

  /* ---- 1. Estimate: the answer is a JSON string; find one key with strstr. ---- */
  char* answer = NULL;
  CHECK(memplan_estimate_json("{\"model\": \"llama-2-7b\", \"gpus\": 4}", &answer));
  const char* key = strstr(answer, "\"params_total\":");
  if (key == NULL) return 1;
  printf("llama-2-7b parameters: %lld\n", strtoll(key + strlen("\"params_total\":"), NULL, 10));
  memplan_string_free(answer);

  /* ---- 2. Open an engine from a Schedule (README, "Schedule JSON"). ---- */
  char schedule[1024];
  snprintf(schedule, sizeof schedule,
           "{\"version\": 1,"
           /* persistence_threshold 0: even these tiny tensors go through NVMe. */
           " \"params\": {\"tier\": \"nvme\", \"dtype\": \"bf16\", \"persistence_threshold\": 0,"
           "              \"buffer_bytes\": 4096, \"buffer_count\": 2},"
           " \"optimizer\": {\"tier\": \"nvme\", \"name\": \"adam\", \"sub_group_elements\": 1024},"
           /* direct: false, because a temporary directory may be on tmpfs (no O_DIRECT). */
           " \"nvme\": {\"path\": \"%s\", \"direct\": false}}",
           argv[1]);
  memplan_engine* engine = NULL;
  CHECK(memplan_engine_open(schedule, "{\"runtime\": \"host\"}", &engine));

  /* The model: h = W1 x + b1 ("layer1"), y = W2 h + b2 ("layer2"). The initial values are read
   * during memplan_engine_start, so these arrays must live until then. */
  static const float w1_init[kHidden * kIn] = {0.1f,  -0.2f, 0.3f, 0.0f, 0.2f,  0.1f,
                                               -0.1f, 0.1f,  0.0f, 0.3f, -0.3f, 0.2f};
  static const float w2_init[kHidden] = {0.2f, -0.1f, 0.1f, 0.3f};
  const int64_t w1_shape[2] = {kHidden, kIn}, b1_shape[1] = {kHidden};
  const int64_t w2_shape[2] = {1, kHidden}, b2_shape[1] = {1};
  uint32_t w1, b1, w2, b2;
  CHECK(memplan_engine_register(engine, "layer1.weight", "layer1", w1_shape, 2, w1_init, &w1));
  CHECK(memplan_engine_register(engine, "layer1.bias", "layer1", b1_shape, 1, NULL, &b1));
  CHECK(memplan_engine_register(engine, "layer2.weight", "layer2", w2_shape, 2, w2_init, &w2));
  CHECK(memplan_engine_register(engine, "layer2.bias", "layer2", b2_shape, 1, NULL, &b2));
  CHECK(memplan_engine_start(engine));

  /* The data: targets from a fixed linear function of x. */
  float x[kSamples][kIn], t[kSamples];
  for (int n = 0; n < kSamples; ++n) {
    for (int k = 0; k < kIn; ++k) x[n][k] = (float)((n * 3 + k * 5) % 7) / 7.0f - 0.5f;
    t[n] = 1.5f * x[n][0] - 2.0f * x[n][1] + 0.5f * x[n][2] + 0.25f;
  }

  /* Gradients must stay valid until memplan_engine_step, hence outside the loop. */
  float g_w1[kHidden * kIn], g_b1[kHidden], g_w2[kHidden], g_b2[1];
  float first_loss = 0, loss = 0;
  for (int step = 1; step <= kSteps; ++step) {
    float h[kSamples][kHidden], dy[kSamples];
    void *pw1, *pb1, *pw2, *pb2;

    /* Forward, one module at a time: fetch, use the working copies, release. */
    CHECK(memplan_engine_fetch(engine, "layer1"));
    CHECK(memplan_engine_device_pointer(engine, w1, &pw1));
    CHECK(memplan_engine_device_pointer(engine, b1, &pb1));
    for (int n = 0; n < kSamples; ++n) {
      for (int j = 0; j < kHidden; ++j) {
        h[n][j] = Bf16(pb1, j);
        for (int k = 0; k < kIn; ++k) h[n][j] += Bf16(pw1, j * kIn + k) * x[n][k];
      }
    }
    CHECK(memplan_engine_release(engine, "layer1"));
    CHECK(memplan_engine_fetch(engine, "layer2"));
    CHECK(memplan_engine_device_pointer(engine, w2, &pw2));
    CHECK(memplan_engine_device_pointer(engine, b2, &pb2));
    loss = 0;
    for (int n = 0; n < kSamples; ++n) {
      float y = Bf16(pb2, 0);
      for (int j = 0; j < kHidden; ++j) y += Bf16(pw2, j) * h[n][j];
      loss += 0.5f * (y - t[n]) * (y - t[n]) / kSamples;
      dy[n] = (y - t[n]) / kSamples;
    }

    /* Backward, in reverse order: layer2 is still fetched; then layer1 again. Each gradient is
     * handed over (fp32) as soon as it is complete. */
    memset(g_w2, 0, sizeof g_w2);
    g_b2[0] = 0;
    for (int n = 0; n < kSamples; ++n) {
      g_b2[0] += dy[n];
      for (int j = 0; j < kHidden; ++j) g_w2[j] += dy[n] * h[n][j];
    }
    CHECK(memplan_engine_grad_ready(engine, w2, g_w2, MEMPLAN_FLOAT32));
    CHECK(memplan_engine_grad_ready(engine, b2, g_b2, MEMPLAN_FLOAT32));
    float w2_now[kHidden];
    for (int j = 0; j < kHidden; ++j) w2_now[j] = Bf16(pw2, j);
    CHECK(memplan_engine_release(engine, "layer2"));
    CHECK(memplan_engine_fetch(engine, "layer1"));
    memset(g_w1, 0, sizeof g_w1);
    memset(g_b1, 0, sizeof g_b1);
    for (int n = 0; n < kSamples; ++n) {
      for (int j = 0; j < kHidden; ++j) {
        const float dh = dy[n] * w2_now[j];
        g_b1[j] += dh;
        for (int k = 0; k < kIn; ++k) g_w1[j * kIn + k] += dh * x[n][k];
      }
    }
    CHECK(memplan_engine_grad_ready(engine, w1, g_w1, MEMPLAN_FLOAT32));
    CHECK(memplan_engine_grad_ready(engine, b1, g_b1, MEMPLAN_FLOAT32));
    CHECK(memplan_engine_release(engine, "layer1"));

    /* The optimizer step (AdamW; keys as integration/engine_json.h lists them). */
    CHECK(memplan_engine_step(engine, "{\"lr\": 0.05, \"weight_decay\": 0.0}"));
    printf("step %d: loss %.6f\n", step, loss);
    if (step == 1) first_loss = loss;
  }

  char* stats = NULL;
  CHECK(memplan_engine_stats_json(engine, &stats));
  printf("engine statistics: %s\n", stats);
  memplan_string_free(stats);
  CHECK(memplan_engine_close(engine));

  if (!(loss < 0.5f * first_loss)) {
    fprintf(stderr, "the loss did not go down: %f -> %f\n", first_loss, loss);
    return 1;
  }
  return 0;
}
