// A CUDA device that does nothing, for a CPU-only build of torch: just enough for fake CUDA tensors to run
// forward *and* backward (autograd opens device guards and asks the CUDA hooks about the device).
//
// Loaded with ctypes (RTLD_GLOBAL) before `import torch`; see tests/cuda_sim/shim.py. It never runs a kernel: every
// tensor on "cuda" is a FakeTensor, whose ops run as meta kernels. Two no-op pieces:
//   1. a DeviceGuardImplInterface for DeviceType::CUDA (device 0 of 1, default stream, events always complete),
//      stored only if the slot is empty (never over a real CUDA build's);
//   2. CUDAHooks reporting CUDA built and available with one device, and no cuDNN (claiming cuDNN sends LSTM/GRU to a
//      DispatchStub with no CUDA kernel and makes convolutions ask for cuDNN's version).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

struct SimulatedCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream getDefaultStream(Device) const override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream getNewStream(Device, int) const override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream exchangeStream(Stream) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
};

struct SimulatedCudaHooks final : public at::CUDAHooksInterface {
  explicit SimulatedCudaHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasCuDNN() const override { return false; }
  bool compiledWithCuDNN() const override { return false; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  DeviceIndex current_device() const override { return 0; }
  int getNumGPUs() const override { return 1; }
  void setCurrentDevice(DeviceIndex) const override {}
  DeviceIndex exchangeDevice(DeviceIndex) const override { return 0; }
  DeviceIndex maybeExchangeDevice(DeviceIndex) const override { return 0; }
  void deviceSynchronize(DeviceIndex) const override {}
};

struct Install {
  Install() {
    auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)];
    if (slot.load() == nullptr) {
      static SimulatedCudaGuard guard;  // leaked on purpose, like torch's own registrations
      slot.store(&guard);
    }
  }
};
Install install;

}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", SimulatedCudaHooks)
}  // namespace at

extern "C" int lightning_comp_cuda_sim_loaded() { return 1; }
