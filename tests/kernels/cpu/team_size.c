/* A probe for tests/kernels/cpu/test_library.py: the size of the calling thread's OpenMP
   team, as a kernel's plain `omp parallel` region gets it. */
#include <omp.h>

void team_size(int *size) {
#pragma omp parallel
    {
#pragma omp single
        *size = omp_get_num_threads();
    }
}
