// Stand-in for CUDA's <cuda_runtime_api.h> in the CUDA simulation harness.
#pragma once
#include "../cuda_sim.h"
