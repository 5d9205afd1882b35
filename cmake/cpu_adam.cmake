# The portable CPU Adam extension `_cpu`, built on every platform.
# Each SIMD build is its own object library with its own -m flags; dispatch.cpp picks one at run
# time, so a wheel keeps the platform baseline (SSE2 on x86-64) yet runs AVX2 or AVX-512.

# -ffp-contract=off: fused multiply-adds would make the SIMD paths round differently from the
# scalar path and the reference. -fno-math-errno lets sqrt vectorize (3.4x faster, measured on x86-64).
set(MFA_CPU_MATH_FLAGS -ffp-contract=off -fno-math-errno -fno-fast-math)

function(mfa_isa_objects name)
  add_library(mfa_isa_${name} OBJECT src/cpu/adam_${name}.cpp)
  set_target_properties(mfa_isa_${name} PROPERTIES POSITION_INDEPENDENT_CODE ON CXX_VISIBILITY_PRESET hidden)
  target_compile_options(mfa_isa_${name} PRIVATE ${MFA_CPU_MATH_FLAGS} ${ARGN})
  set(MFA_ISA_OBJECTS ${MFA_ISA_OBJECTS} $<TARGET_OBJECTS:mfa_isa_${name}> PARENT_SCOPE)
endfunction()

# The target, not the build machine: on macOS an arm64 wheel may be built on an x86-64 host.
set(MFA_TARGET_PROCESSOR "${CMAKE_SYSTEM_PROCESSOR}")
if(APPLE AND CMAKE_OSX_ARCHITECTURES)
  list(LENGTH CMAKE_OSX_ARCHITECTURES MFA_N_ARCHS)
  if(NOT MFA_N_ARCHS EQUAL 1)
    message(FATAL_ERROR "Build one architecture at a time (CMAKE_OSX_ARCHITECTURES=${CMAKE_OSX_ARCHITECTURES}): the SIMD objects are per architecture")
  endif()
  set(MFA_TARGET_PROCESSOR "${CMAKE_OSX_ARCHITECTURES}")
endif()

set(MFA_ISA_OBJECTS "")
if(MFA_TARGET_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  mfa_isa_objects(scalar)
  mfa_isa_objects(avx2 -mavx2 -mfma -mf16c)
  mfa_isa_objects(avx512 -mavx512f -mavx2 -mfma -mf16c)
  # AVX512_VBMI: the 8-bit kernel's byte-permute table lookups. Every CPU with AVX512_BF16 but
  # Cooper Lake has it; that one takes the avx512 build.
  mfa_isa_objects(avx512bf16 -mavx512f -mavx512bf16 -mavx512dq -mavx512vl -mavx512bw -mavx512vbmi -mavx2 -mfma -mf16c)
elseif(MFA_TARGET_PROCESSOR MATCHES "^(aarch64|arm64|ARM64)$")
  mfa_isa_objects(scalar)
  mfa_isa_objects(neon)
else()
  mfa_isa_objects(scalar)
endif()

nanobind_add_module(_cpu NB_STATIC
  src/cpu/bindings.cpp src/cpu/adam8bit.cpp src/cpu/adam4bit.cpp src/cpu/step_plan.cpp src/cpu/tensor_handles.cpp src/cpu/dispatch.cpp src/cpu/step.cpp src/cpu/thread_pool.cpp
  src/cpu/zenflow_ctrl.cpp
  src/cpu/torch_openmp.cpp ${MFA_ISA_OBJECTS})
target_compile_options(_cpu PRIVATE ${MFA_CPU_MATH_FLAGS})
find_package(Threads REQUIRED)
# dlopen/dlsym: torch_openmp.cpp borrows the OpenMP runtime torch loaded (nothing is linked).
target_link_libraries(_cpu PRIVATE Threads::Threads ${CMAKE_DL_LIBS})
install(TARGETS _cpu LIBRARY DESTINATION mps_fused_adam)
