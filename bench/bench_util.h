// What the CUDA benchmarks share: a fatal-error check and the timing of a chain of launches
// replayed as one CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(expr)                                                     \
  do {                                                                  \
    const cudaError_t status_ = (expr);                                 \
    if (status_ != cudaSuccess) {                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(status_));                        \
      std::exit(1);                                                     \
    }                                                                   \
  } while (0)

// Median µs per link of a graph holding `links` launches of `enqueue(i)`.
template <typename Enqueue>
double time_chain(int links, Enqueue enqueue, cudaStream_t stream) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < links; ++i) CHECK(enqueue(i));
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(exec, stream));
  const int replays = 10;
  std::vector<double> samples;
  for (int round = 0; round < 5; ++round) {
    CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < replays; ++i) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    samples.push_back(1000.0 * ms / (replays * links));
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}
