# Whether Apple's Metal compiler runs: mfa_metal_toolchain(<ok var> <message var>). Included by
# apple_metal.cmake; also runs on its own, for the tests and for a user asking why a build has no
# metallib: `cmake -P cmake/metal_toolchain.cmake` prints "metal toolchain: found|missing: ...".
# Untested on Apple hardware (tests/test_metal_sources.py runs it with stand-in `xcrun`s).
function(mfa_metal_toolchain ok_var message_var)
  # Run the compiler: without Xcode 26's separate Metal toolchain, `xcrun -f metal` still finds a
  # stub that only prints "cannot execute tool 'metal' due to missing Metal Toolchain"; with only
  # the Command Line Tools there is no `metal` at all.
  execute_process(COMMAND xcrun -sdk macosx metal --version RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(STRIP "${out}" out)
  if(NOT rc EQUAL 0 OR out MATCHES "missing Metal Toolchain")
    set(${ok_var} FALSE PARENT_SCOPE)
    set(${message_var} "xcrun -sdk macosx metal --version: ${rc}: ${out}" PARENT_SCOPE)
  else()
    set(${ok_var} TRUE PARENT_SCOPE)
    set(${message_var} "${out}" PARENT_SCOPE)
  endif()
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  mfa_metal_toolchain(ok why)
  if(ok)
    message("metal toolchain: found: ${why}")
  else()
    message("metal toolchain: missing: ${why}")
  endif()
endif()
