// Syntax-check stand-in for <mach-o/dyld.h> (see Foundation/Foundation.h here).
#pragma once
#include <stdint.h>
extern "C" uint32_t _dyld_image_count(void);
extern "C" const char* _dyld_get_image_name(uint32_t image_index);
