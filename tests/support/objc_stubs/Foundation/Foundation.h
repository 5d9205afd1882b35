// Syntax-check stand-in for Apple's Foundation: only the declarations src/metal/metal_adam.mm
// uses, spelled as in Apple's documentation. Lets clang parse the .mm on Linux; checks no behaviour.
// tests/test_apple_artifacts.py checks every declaration here and in Metal/, mach-o/ against
// pyobjc's macOS metadata (names, argument counts, type encodings) and that the .mm uses it.
#pragma once
#include <stddef.h>
typedef unsigned long NSUInteger;
#define nil nullptr
@protocol NSObject
@end
__attribute__((objc_root_class)) @interface NSObject <NSObject>
@end
@interface NSString : NSObject
+ (instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property(readonly) const char* UTF8String;
@end
@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end
@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)path;
@end
@protocol OS_dispatch_queue <NSObject>
@end
typedef NSObject<OS_dispatch_queue>* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);
extern "C" void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
