/**
 * Those waiting for something to happen: `wait` resolves with the first value
 * released after it was called that it accepts, or with undefined once its
 * `timeoutMs` passed; either way the waiter is forgotten.
 */
export class Waiters<T> {
  private readonly waiting = new Set<(value: T) => void>();

  wait(timeoutMs: number, accepts: (value: T) => boolean = () => true): Promise<T | undefined> {
    return new Promise((resolve) => {
      const settle = (value: T | undefined): void => {
        clearTimeout(timer);
        this.waiting.delete(offer);
        resolve(value);
      };
      const offer = (value: T): void => {
        if (accepts(value)) {
          settle(value);
        }
      };
      const timer = setTimeout(() => settle(undefined), timeoutMs);
      this.waiting.add(offer);
    });
  }

  /** Offer `value` to everyone waiting now. */
  release(value: T): void {
    for (const offer of [...this.waiting]) {
      offer(value);
    }
  }
}
