/* A C program built against an installed memplan through pkg-config (tests/consumer/run.sh):
 * `cc c_main.c $(pkg-config --cflags --libs memplan)`. Checks GPT-2's parameter count through the
 * C API's estimate. */
#include <stdio.h>
#include <string.h>

#include "memplan.h"

int main(void) {
  char* answer = NULL;
  if (memplan_estimate_path("gpt2", 4, 1, &answer) != MEMPLAN_OK) {
    fprintf(stderr, "c consumer: %s\n", memplan_last_error());
    return 1;
  }
  const int ok = strstr(answer, "\"params_total\":124439808") != NULL ||
                 strstr(answer, "\"params_total\": 124439808") != NULL;
  memplan_string_free(answer);
  if (!ok) {
    fprintf(stderr, "c consumer: gpt2's params_total is not 124439808\n");
    return 1;
  }
  printf("c consumer (pkg-config, memplan %s): gpt2 params_total 124439808\n", memplan_version());
  return 0;
}
