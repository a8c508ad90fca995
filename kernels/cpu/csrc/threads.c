#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>

/* Confine the calling thread and every member of its OpenMP team to the `count` cores: each
   sets its own mask in one parallel region. Returns how many threads could not. */
int bind_team(const int64_t *cores, int64_t count) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int64_t i = 0; i < count; ++i) CPU_SET((int)cores[i], &set);
    int failed = 0;
#pragma omp parallel reduction(+ : failed)
    failed += sched_setaffinity(0, sizeof set, &set) != 0;
    return failed;
}
