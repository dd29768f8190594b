/* A MoE layer through the MoonEP C API, in plain C99, under mpirun:
 *
 *   mpirun -np 4 build/bin/moonep_example_c
 *
 * Every rank draws the same expert weights from a seed, keeps its E/R home experts, routes its
 * own tokens with a skewed router, runs forward and backward through MoonEP, and checks y against
 * a naive reference computed here for its own tokens. Exit code 0 when every rank matches. */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moonep/moonep.h>
#include <moonep/moonep_runtime.h>

#define CHECK(call)                                                                  \
  do {                                                                               \
    moonepResult_t r_ = (call);                                                      \
    if (r_ != moonepSuccess) {                                                       \
      fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,              \
              moonepGetErrorString(r_), moonepGetLastThreadError());                 \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                  \
    }                                                                                \
  } while (0)

enum { kExpertsPerRank = 4, kTopK = 2, kHidden = 32, kInter = 64, kTokens = 48 };

/* A small deterministic generator (same numbers on every rank for the same seed). */
static double Uniform(unsigned long long* state) {
  *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
  return (double)(*state >> 11) / 9007199254740992.0;
}

static float Silu(float a) { return a / (1.0f + expf(-a)); }

int main(int argc, char** argv) {
  int rank, size, e, t, k, i, j;
  MPI_Init(&argc, &argv);
  MPI_Comm world = MPI_COMM_WORLD;
  moonepComm_t comm;
  CHECK(moonepCommInitMpi(&comm, &world));
  CHECK(moonepCommRank(comm, &rank));
  CHECK(moonepCommSize(comm, &size));
  const int E = kExpertsPerRank * size;
  const size_t block = (size_t)kHidden * kInter;

  /* All experts' weights (same on every rank), then this rank's home experts. */
  float* wg = malloc(sizeof(float) * E * block);
  float* wu = malloc(sizeof(float) * E * block);
  float* wd = malloc(sizeof(float) * E * block);
  unsigned long long seed = 42;
  for (i = 0; i < (int)(E * block); ++i) {
    wg[i] = (float)((Uniform(&seed) - 0.5) * 0.6);
    wu[i] = (float)((Uniform(&seed) - 0.5) * 0.6);
    wd[i] = (float)((Uniform(&seed) - 0.5) * 0.6);
  }
  float* grads = calloc(3 * kExpertsPerRank * block, sizeof(float));
  moonepExpertTensors_t weights = {wg + rank * kExpertsPerRank * block,
                                   wu + rank * kExpertsPerRank * block,
                                   wd + rank * kExpertsPerRank * block, moonepFloat32};
  moonepExpertTensors_t grad_tensors = {grads, grads + kExpertsPerRank * block,
                                        grads + 2 * kExpertsPerRank * block, moonepFloat32};

  moonepLayerConfig_t config = MOONEP_LAYER_CONFIG_INITIALIZER;
  config.num_experts = E;
  config.top_k = kTopK;
  config.hidden = kHidden;
  config.intermediate = kInter;
  config.dtype = moonepFloat32;
  config.max_tokens = kTokens;
  config.num_threads = 1;
  moonepLayer_t layer;
  CHECK(moonepLayerCreate(comm, &config, &layer));
  CHECK(moonepLayerBindParams(layer, &weights, &grad_tensors));

  /* This rank's tokens; a router that prefers the low expert ids (skew). */
  float x[kTokens * kHidden], y[kTokens * kHidden], dy[kTokens * kHidden], dx[kTokens * kHidden];
  int32_t ids[kTokens * kTopK];
  float topw[kTokens * kTopK], dtopw[kTokens * kTopK];
  unsigned long long tok_seed = 1000 + (unsigned long long)rank;
  for (i = 0; i < kTokens * kHidden; ++i) {
    x[i] = (float)(Uniform(&tok_seed) - 0.5);
    dy[i] = (float)(Uniform(&tok_seed) - 0.5);
  }
  for (t = 0; t < kTokens; ++t) {
    const int first = (int)(E * Uniform(&tok_seed) * Uniform(&tok_seed));
    ids[t * kTopK] = first;
    ids[t * kTopK + 1] = (first + 1 + (int)((E - 1) * Uniform(&tok_seed))) % E;
    topw[t * kTopK] = 0.7f;
    topw[t * kTopK + 1] = 0.3f;
  }

  moonepLayerHandle_t handle;
  CHECK(moonepLayerForward(layer, kTokens, x, ids, topw, y, &handle, NULL)); /* NULL: no stream (CPU) */
  CHECK(moonepLayerBackward(layer, handle, dy, dx, dtopw, NULL));
  moonepStepStats_t stats = MOONEP_STEP_STATS_INITIALIZER;
  CHECK(moonepLayerGetStats(layer, &stats));

  /* Reference y for this rank's tokens. */
  double max_err = 0.0, max_ref = 0.0;
  for (t = 0; t < kTokens; ++t) {
    float ref[kHidden];
    memset(ref, 0, sizeof(ref));
    for (k = 0; k < kTopK; ++k) {
      e = ids[t * kTopK + k];
      float h[kInter];
      for (j = 0; j < kInter; ++j) {
        float a = 0.0f, b = 0.0f;
        for (i = 0; i < kHidden; ++i) {
          a += x[t * kHidden + i] * wg[e * block + (size_t)i * kInter + j];
          b += x[t * kHidden + i] * wu[e * block + (size_t)i * kInter + j];
        }
        h[j] = Silu(a) * b;
      }
      for (i = 0; i < kHidden; ++i) {
        float o = 0.0f;
        for (j = 0; j < kInter; ++j) o += h[j] * wd[e * block + (size_t)j * kHidden + i];
        ref[i] += topw[t * kTopK + k] * o;
      }
    }
    for (i = 0; i < kHidden; ++i) {
      const double d = fabs((double)y[t * kHidden + i] - ref[i]);
      if (d > max_err) max_err = d;
      if (fabs(ref[i]) > max_ref) max_ref = fabs(ref[i]);
    }
  }
  double rel = max_ref > 0 ? max_err / max_ref : max_err, worst = 0.0;
  MPI_Allreduce(&rel, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) {
    printf("moonep_example_c: %d ranks, %d experts, top-%d: load max/mean %.2f without MoonEP, "
           "%.2f with it (%d replicas); y vs reference: max rel error %.1e -> %s\n",
           size, E, kTopK, stats.max_load_before / stats.mean_load,
           stats.max_load_after / stats.mean_load, stats.replicas, worst,
           worst < 1e-4 ? "PASS" : "FAIL");
  }
  CHECK(moonepLayerDestroy(layer));
  CHECK(moonepCommDestroy(comm));
  free(wg);
  free(wu);
  free(wd);
  free(grads);
  MPI_Finalize();
  return worst < 1e-4 ? 0 : 1;
}
