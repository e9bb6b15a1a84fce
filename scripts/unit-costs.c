// Unit costs of the machine it runs on: a clock read, a trivial syscall, a
// thread wake-up round trip (docs/benchmarks.md, "The emulated VM: what its
// times mean"). Prints one line per cost. Usage, from the repository root
// (the VM shares it), on the host and in the Soft-RoCE VM:
//   gcc -O2 -pthread -o target/unit-costs scripts/unit-costs.c
//   target/unit-costs
//   ../shared/softroce/run-in-softroce-vm.sh target/unit-costs
#define _GNU_SOURCE
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <pthread.h>
#include <stdatomic.h>
#include <linux/futex.h>
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
static atomic_int turn; static int N=20000;
static void* peer(void*a){ for(int i=0;i<N;i++){ while(atomic_load(&turn)!=1) syscall(SYS_futex,&turn,FUTEX_WAIT_PRIVATE,0,0,0,0); atomic_store(&turn,0); syscall(SYS_futex,&turn,FUTEX_WAKE_PRIVATE,1,0,0,0);} return 0;}
int main(){
  int n=200000; struct timespec t; double a=now();
  for(int i=0;i<n;i++) clock_gettime(CLOCK_MONOTONIC,&t);
  double b=now(); printf("clock_gettime(MONOTONIC): %.3f us\n",(b-a)/n*1e6);
  a=now(); for(int i=0;i<n;i++) clock_gettime(CLOCK_MONOTONIC_COARSE,&t); b=now();
  printf("clock_gettime(MONOTONIC_COARSE): %.3f us\n",(b-a)/n*1e6);
  a=now(); for(int i=0;i<n;i++) syscall(SYS_getppid); b=now(); printf("getppid syscall: %.3f us\n",(b-a)/n*1e6);
  pthread_t p; pthread_create(&p,0,peer,0); a=now();
  for(int i=0;i<N;i++){ atomic_store(&turn,1); syscall(SYS_futex,&turn,FUTEX_WAKE_PRIVATE,1,0,0,0); while(atomic_load(&turn)!=0) syscall(SYS_futex,&turn,FUTEX_WAIT_PRIVATE,1,0,0,0);} 
  b=now(); pthread_join(p,0); printf("futex ping-pong round trip (2 wakes): %.3f us\n",(b-a)/N*1e6);
  FILE*f=fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource","r"); char s[64]={0}; if(f){fgets(s,64,f); printf("clocksource: %s",s);} 
  return 0;}
