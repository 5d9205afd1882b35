# Apple only (included under if(APPLE)): the ahead-of-time fused_adam.metallib and the `_metal`
# extension, both installed into mps_fused_adam/ side by side. Nothing of torch is needed here:
# `_metal` looks torch::mps::* up at run time in the libtorch `import torch` loaded.
# Untested on Apple hardware until the release pipeline's Apple Silicon job has run.
enable_language(OBJCXX)

# bfloat needs Metal 3.1 (macOS 14), PyTorch's MPS minimum. (The extension's own deployment
# target comes from CMAKE_OSX_DEPLOYMENT_TARGET / MACOSX_DEPLOYMENT_TARGET, set before project().)
set(MFA_MACOS_MIN 14.0)

# Without a Metal compiler that runs (Command Line Tools only; Xcode 26 without its separate
# Metal toolchain) the build warns and goes on without the metallib: `_cpu`, the .metal source and
# `_metal` still install, and on MPS the package runs tier 3 (the bundled source compiled at run
# time), which backend_info() reports with the reason. Release wheels must have it:
# ci/check_wheel.py requires fused_adam.metallib in a macOS wheel.
include(${CMAKE_CURRENT_LIST_DIR}/metal_toolchain.cmake)
mfa_metal_toolchain(MFA_HAVE_METAL MFA_METAL_WHY)
if(NOT MFA_HAVE_METAL)
  message(WARNING "mps-fused-adam: the Metal compiler does not run (${MFA_METAL_WHY}). Building "
                  "without fused_adam.metallib: on MPS the kernels are then compiled at run time "
                  "from the bundled source (tier 3). For the prebuilt tiers install Xcode's Metal "
                  "toolchain (Xcode 26: xcodebuild -downloadComponent MetalToolchain) and rebuild.")
endif()

# Fast math off, as MLX and PyTorch build their kernels; in the MSL specification that mode
# ("safe") still contracts a * b + c into fma, so contraction is switched off explicitly.
set(MFA_METAL_FLAGS -std=metal3.1 -mmacosx-version-min=${MFA_MACOS_MIN} -fno-fast-math
                    -ffp-contract=off -Wall -Wextra)

if(MFA_HAVE_METAL)
  file(GLOB MFA_METAL_SOURCES CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/metal/*.metal")
  set(MFA_AIR_FILES "")
  foreach(src ${MFA_METAL_SOURCES})
    get_filename_component(stem "${src}" NAME_WE)
    set(air "${CMAKE_CURRENT_BINARY_DIR}/${stem}.air")
    add_custom_command(
      OUTPUT "${air}"
      COMMAND xcrun -sdk macosx metal ${MFA_METAL_FLAGS} -c "${src}" -o "${air}"
      DEPENDS "${src}"
      COMMENT "Compiling ${stem}.metal to AIR"
      VERBATIM)
    list(APPEND MFA_AIR_FILES "${air}")
  endforeach()

  set(MFA_METALLIB "${CMAKE_CURRENT_BINARY_DIR}/fused_adam.metallib")
  add_custom_command(
    OUTPUT "${MFA_METALLIB}"
    COMMAND xcrun -sdk macosx metallib ${MFA_AIR_FILES} -o "${MFA_METALLIB}"
    DEPENDS ${MFA_AIR_FILES}
    COMMENT "Linking fused_adam.metallib"
    VERBATIM)
  add_custom_target(mfa_metallib ALL DEPENDS "${MFA_METALLIB}")
  install(FILES "${MFA_METALLIB}" DESTINATION mps_fused_adam)
endif()

nanobind_add_module(_metal NB_STATIC src/metal/metal_adam.mm)
if(MFA_HAVE_METAL)
  add_dependencies(_metal mfa_metallib)
endif()
target_compile_options(_metal PRIVATE -fobjc-arc)
find_library(MFA_METAL_FRAMEWORK Metal REQUIRED)
find_library(MFA_FOUNDATION_FRAMEWORK Foundation REQUIRED)
target_link_libraries(_metal PRIVATE ${MFA_METAL_FRAMEWORK} ${MFA_FOUNDATION_FRAMEWORK})
install(TARGETS _metal LIBRARY DESTINATION mps_fused_adam)
